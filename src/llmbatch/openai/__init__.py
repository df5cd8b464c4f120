"""OpenAI's wire format, in one place.

- :mod:`~llmbatch.openai.vocab`: the endpoints, the request fields, the response objects' names.
- :mod:`~llmbatch.openai.requests`: a request body -> an llmbatch row (the one rule set for batch
  files, ``llmbatch serve`` and the Ray Serve deployment).
- :mod:`~llmbatch.openai.responses`: answered rows -> a response object or a batch output line.
- :mod:`~llmbatch.openai.batch_file`: Batch API input files, read and checked line by line.
- :mod:`~llmbatch.openai.client`: llmbatch as a client of an OpenAI-compatible server (rows ->
  requests, responses -> rows), for the HTTP and Serve engines.
"""
