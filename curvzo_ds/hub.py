"""One short probe of the Hugging Face hub before the first hub download, so that a machine without network fails
at once instead of after half a minute of retries.

Without `HF_HUB_OFFLINE`, huggingface_hub, transformers and datasets each retry an unreachable hub with back-off,
printing a warning per retry. `offline_unless_reachable()` asks once per process (a HEAD request to `HF_ENDPOINT`
through huggingface_hub's own HTTP session, so proxies apply, bounded by PROBE_SECONDS). When nothing answers it
switches this process to offline mode, as `HF_HUB_OFFLINE=1` would: what is cached still loads, and anything else
fails at once with curvzo_ds's one-line error.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("curvzo_ds")
PROBE_SECONDS = 5.0
_reachable: bool | None = None


def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline_unless_reachable() -> bool:
    """False when the hub cannot be reached (this process is then offline); True when it answered, or when offline
    mode was asked for already (nothing to probe)."""
    global _reachable
    if any(_true(os.environ.get(k)) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")):
        return True
    if _reachable is None:
        from huggingface_hub import constants

        _reachable = _probe(constants.ENDPOINT)
        if not _reachable:
            log.warning("the Hugging Face hub (%s) did not answer within %.0f s: working offline, from the local "
                        "cache only (set HF_HUB_OFFLINE=1 to skip this check)", constants.ENDPOINT, PROBE_SECONDS)
            go_offline()
    return _reachable


def _probe(endpoint: str) -> bool:
    answered: list[bool] = []

    def ask() -> None:
        from huggingface_hub.utils import get_session

        try:
            get_session().head(endpoint, timeout=PROBE_SECONDS)  # any HTTP answer means the hub is there
            answered.append(True)
        except Exception:  # noqa: BLE001 - refused, unresolved, timed out: all mean unreachable
            answered.append(False)

    thread = threading.Thread(target=ask, daemon=True)  # a stuck DNS lookup is not bounded by the timeout
    thread.start()
    thread.join(PROBE_SECONDS + 1)
    return bool(answered and answered[0])


def go_offline() -> None:
    """Offline mode for this process and its children: huggingface_hub and transformers read the flag at each call,
    datasets reads its own copy, set here if it is imported already (else it reads the variable on import)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True
