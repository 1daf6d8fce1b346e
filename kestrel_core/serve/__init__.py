"""kestrel serve: an OpenAI-compatible HTTP server over one model and one continuous batch.

protocol.py (OpenAI's request and answer shapes, checked), prompts.py (a request's prompt as ids, within the context),
stops.py (text cut at stop strings), generation.py (a sequence's tokens as the event loop sees them), service.py (the
model, its batch and its shutdown), tokens.py (/tokenize and /detokenize), metrics.py (/metrics: Prometheus'
counters), app.py (the routes), server.py (binding and signals); the command is commands/serve.py.
"""
