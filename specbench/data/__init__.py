"""Question sets and conversations: the benchmark sets (data), their pinned origins (fetch_data, `make data`) and
the chat-template encoding shared by benchmarking and training (conversations). Imports decode and core only.
"""
