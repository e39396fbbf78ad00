"""The running room: the plan, the DeepSpeed config, pre-flight, the engine, the method host, evaluation, the
subspace stage, the results and the staged loop."""
