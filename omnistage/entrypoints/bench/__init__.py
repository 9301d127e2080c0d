"""`omnistage bench`: a load generator for OpenAI-compatible servers and for the in-process engines.

`main.py` (options, the run loop, the table and the JSON), `workload.py` (settings, prompts, arrival
times), `client.py` (HTTP senders: chat, completions, speech, images, videos), `offline.py` (the same
through `AsyncOmni`), `results.py` (per-request records and the summary). Runs in the user's process.
"""
