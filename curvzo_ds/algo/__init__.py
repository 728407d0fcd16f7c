"""The algorithm, pure: CurvZO's sampler and its method table (sampling)."""
