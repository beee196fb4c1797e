"""The engine: scheduler, sequences, sampling and the step loop. Knows no Redis and no HTTP."""
