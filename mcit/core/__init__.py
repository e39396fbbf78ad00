"""The foundation room: registries, the console, the config, atomic writes, locations, ranks, the run directory,
stop requests, metrics and scorers, subspace linear algebra."""
