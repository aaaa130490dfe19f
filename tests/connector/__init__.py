"""Tests of the KV connector: planning, messages, Mooncake transport."""
