"""verifiers environments for tests/envs/test_verifiers.py, written in verifiers' own API (local data only)."""
