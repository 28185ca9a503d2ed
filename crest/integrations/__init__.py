"""crest inside the inference engines people already run: a proposer vLLM loads by name (`crest.integrations.vllm`).

Nothing here is imported by crest itself; each engine's module imports only crest's library layers (drafters,
decoding policy, learning), never the server or the CLI.
"""
