"""OpenAI's wire vocabulary, once: the endpoints, the request fields llmbatch honours (and the
ones it names as unsupported), the response objects' names and the id prefixes.

An endpoint is named by its URL path everywhere (:data:`CHAT` is ``/v1/chat/completions``):
in a batch file's ``url``, in a batch's ``endpoint``, as the kind of a request llmbatch sends
to an OpenAI-compatible endpoint, and as the kind of a request the Serve deployment answers.

Unknown request fields are refused, naming the field (OpenAI's rule: its API answers an
unrecognized argument with a 400). vLLM's server, built on pydantic models with
``extra="allow"``, logs them and goes on; llmbatch follows OpenAI, because an ignored field
(a misspelled constraint, a setting from another server) is a wrong answer with no error, found
only after the whole batch has run. vLLM's own sampling fields are accepted as its server takes
them, and so are its older ``guided_*`` constraint fields (as ``structured_outputs``: llmbatch's
HTTP engine sends them to servers that still want them, and rows still spell them
``guided_decoding``).
"""

from __future__ import annotations

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
#: Endpoint -> the task_type of the model that serves it.
ENDPOINTS = {CHAT: "generate", COMPLETIONS: "generate", EMBEDDINGS: "embed"}
#: Scoring and rerank wait for the score task in the job layer.
LATER_ENDPOINTS = ("/v1/score", "/v1/rerank", "/score", "/rerank", "/v1/responses")
#: Endpoint -> the method of a Ray Serve deployment that answers it (Ray Serve LLM's names).
SERVE_METHODS = {CHAT: "chat", COMPLETIONS: "completions"}
#: Endpoint -> (the response's ``object``, its id prefix).
OBJECTS = {CHAT: ("chat.completion", "chatcmpl-"), COMPLETIONS: ("text_completion", "cmpl-"),
           EMBEDDINGS: ("list", "embd-")}
#: A batch output line's id prefix and its response's request id prefix.
LINE_ID, REQUEST_ID = "batch_req_", "req_"

#: Sampling params with the same name and meaning in OpenAI's API.
OPENAI_PARAMS = ("temperature", "top_p", "max_tokens", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
                 "logit_bias")
#: vLLM's own request fields: its OpenAI server takes them as they are (OpenAI itself refuses
#: them, so llmbatch sends them only when a row asks for them).
VLLM_PARAMS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
               "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
               "truncate_prompt_tokens", "bad_words", "allowed_token_ids", "prompt_logprobs", "thinking_token_budget",
               "repetition_detection", "logprob_token_ids")
#: Engine-side settings with no meaning for an endpoint.
LOCAL_ONLY_PARAMS = ("detokenize", "output_text_buffer_length", "stream_interval", "flat_logprobs",
                     "skip_reading_prefix_cache", "extra_args", "watermarking", "prompt_logprob_token_ids",
                     "prompt_logprob_start")
#: vLLM's older constraint fields (``guided_json``...) and the structured_outputs key each means.
GUIDED = {f"guided_{key}": key for key in ("json", "choice", "regex", "grammar")}
#: How constraints are sent: "auto" (JSON schemas as OpenAI's response_format, choice/regex/
#: grammar as vLLM's structured_outputs) or "guided" (vLLM before 0.11 and servers that copy it:
#: guided_json, guided_choice, guided_regex, guided_grammar).
STRUCTURED_FIELDS = ("auto", "guided")

#: Fields that change nothing in an answer (bookkeeping, delivery): accepted, ignored
#: (``request_id``: vLLM's, and what Ray's processors add to a request).
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
           "prompt_cache_retention", "parallel_tool_calls", "stream_options", "request_id")
#: Request fields that are sampling params of the same name.
SAMPLING = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias")
#: vLLM sampling fields accepted in a request body, passed to the engine as they are.
VLLM_EXTRAS = VLLM_PARAMS + ("structured_outputs",)
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
               "response_format", "stream", "chat_template_kwargs", "tools", "tool_choice", "modalities") \
    + SAMPLING + VLLM_EXTRAS + tuple(GUIDED) + IGNORED
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "logprobs", "echo", "suffix", "best_of", "stream",
                     "response_format") + SAMPLING + VLLM_EXTRAS + tuple(GUIDED) + IGNORED
EMBEDDING_FIELDS = ("model", "input", "encoding_format", "dimensions", "user")
FIELDS = {CHAT: CHAT_FIELDS, COMPLETIONS: COMPLETION_FIELDS, EMBEDDINGS: EMBEDDING_FIELDS}
#: Fields of OpenAI's API that llmbatch does not run (named in the error, never ignored).
NOT_SUPPORTED = {
    "functions": "function calling", "function_call": "function calling", "audio": "audio output",
    "prediction": "predicted outputs", "reasoning_effort": "reasoning effort", "web_search_options": "web search",
    "verbosity": "verbosity", "logprobs_start": None,
}
#: Sampling parameter bounds as OpenAI documents them.
RANGES = {"temperature": (0, 2), "top_p": (0, 1), "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2),
          "n": (1, 128), "top_logprobs": (0, 20)}

