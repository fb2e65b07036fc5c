"""Helpers of the test suite (test_vesti.py); its data is in fixtures/."""
