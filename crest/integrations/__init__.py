"""crest inside the inference engines people already run: a proposer vLLM loads by name (`crest.integrations.vllm`),
and vLLM writing the model's own answers (`crest.integrations.vllm_answers`, for `crest answer --engine vllm`).

Only the CLI imports these modules; each imports only crest's library layers (drafters, decoding, learning), never
the server or the CLI.
"""
