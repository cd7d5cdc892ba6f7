"""Settings, read from environment variables with defaults.

The limits are sized so that a 2-core, 24 GiB machine serves every request it
accepts (see README, "Limits").
"""
import os


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


class Config:
    BLOCKGRAD_DEVICE = os.environ.get("BLOCKGRAD_DEVICE", "auto")
    # A JSON number can take 2 bytes ("1,"): 32 MiB bounds a body at ~16M numbers, as Python
    # objects while parsing. N=4096, D=64 at full float64 precision is ~5.5 MB.
    BLOCKGRAD_MAX_BODY_BYTES = env_int("BLOCKGRAD_MAX_BODY_BYTES", 32 * 1024 * 1024)
    BLOCKGRAD_MAX_N = env_int("BLOCKGRAD_MAX_N", 8192)
    BLOCKGRAD_MAX_D = env_int("BLOCKGRAD_MAX_D", 4096)
    # Numbers in one answer (blocks + accumulated + losses): N=512, D=64 in full is 33.6M.
    BLOCKGRAD_MAX_OUTPUT_ELEMENTS = env_int("BLOCKGRAD_MAX_OUTPUT_ELEMENTS", 64 * 1024 * 1024)
    # Numbers in one block (rows x cols x 2D): 4M float64 is 32 MiB a tensor.
    BLOCKGRAD_MAX_BLOCK_ELEMENTS = env_int("BLOCKGRAD_MAX_BLOCK_ELEMENTS", 4 * 1024 * 1024)
    BLOCKGRAD_REQUEST_TIMEOUT_S = env_float("BLOCKGRAD_REQUEST_TIMEOUT_S", 60.0)
    BLOCKGRAD_LOG_LEVEL = os.environ.get("BLOCKGRAD_LOG_LEVEL", "INFO")
    # Optional bearer token for every route but the probes (app/auth.py); unset = open.
    BLOCKGRAD_API_TOKEN = os.environ.get("BLOCKGRAD_API_TOKEN") or None

    API_TITLE = "blockgrad"
    API_VERSION = "1.0.0"
    OPENAPI_VERSION = "3.0.3"
    OPENAPI_URL_PREFIX = "/"
    OPENAPI_JSON_PATH = "openapi.json"
    OPENAPI_SWAGGER_UI_PATH = "docs"
    OPENAPI_SWAGGER_UI_URL = "docs/assets/"  # relative to /docs; served by app/docs.py, no CDN
    OPENAPI_SWAGGER_UI_CONFIG = {"validatorUrl": None}  # no badge fetched from swagger.io
