"""The engine: sequences, the block manager and scheduler, the model runner, sampling and per-request outputs."""
