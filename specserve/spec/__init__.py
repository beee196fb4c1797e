"""The speculative-decoding layer: proposers (n-gram, draft model), verification, and the adaptive policy
that picks k. It depends on the engine's small data types (Sequence, SchedulerOutput, DraftBatch, Accepted),
never on LLMEngine itself."""
