"""Hydra recipes (GSM8K, Txt2SQL, long-context QA, a toy task), tasks and the built-in GRPO driver."""
