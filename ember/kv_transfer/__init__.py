"""Disaggregated serving: a prefill replica hands a prompt's KV blocks to a decode replica."""
