"""Speculative decoding: proposers guess the next tokens cheaply, one verify step through every
stage checks them (`vllm.spec_decode.config`, `ngram`, `planner`, `verify`)."""
