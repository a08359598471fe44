"""Helpers the tests share: tiny models built from configs, fake requests, a server thread."""
