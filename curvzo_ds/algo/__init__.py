"""The algorithm, pure: CurvZO's sampler and its method table (sampling), and the static element mask (mask)."""
