"""The studies room: sweeps (spec, launch, results), the comparison report and a study's tables and figures."""
