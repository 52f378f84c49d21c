"""Test doubles and harnesses (never installed): fake device, service harness, toy tokenizers."""
