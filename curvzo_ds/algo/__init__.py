"""The algorithm, pure: CurvZO's sampler and its method table (sampling), the per-block score estimators
(estimators), and the finite-difference estimators with their table (differences)."""
