"""Speculative decoding: proposers guess a request's next tokens; one target forward over the
guesses decides how many to keep (verify.py)."""
