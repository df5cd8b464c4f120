import dataclasses
from typing import Optional

@dataclasses.dataclass
class ServerArgs:
    model_path: str = ""
    context_length: Optional[int] = None
    load_format: str = "auto"
    mem_fraction_static: Optional[float] = None
    sampling_backend: Optional[str] = None
    log_level: str = "info"
    skip_tokenizer_init: bool = False
    max_running_requests: Optional[int] = None
    disable_radix_cache: bool = False
