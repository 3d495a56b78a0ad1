"""The Hub's failures as one-line ``ModelLoadError``\\ s that name the id and say what to do, without HTTP dumps."""

from __future__ import annotations

from dataclasses import dataclass

from vllite.exceptions import ModelLoadError


@dataclass(frozen=True)
class HubRequest:
    """What was asked of the Hub: for the error messages."""

    repo_id: str
    kind: str  # "model" or "tokenizer"
    revision: str | None
    cache_dir: str
    endpoint: str
    offline: bool

    @property
    def what(self) -> str:
        return f"{self.kind.capitalize()} {self.repo_id!r}"

    @property
    def revision_flag(self) -> str:
        return "--revision" if self.kind == "model" else "--tokenizer-revision"

    @property
    def at_revision(self) -> str:
        return f" (revision {self.revision!r})" if self.revision else ""


def hub_error(exc: BaseException, request: HubRequest) -> ModelLoadError | None:
    """The ``ModelLoadError`` for ``exc`` raised by ``huggingface_hub`` while resolving ``request``; ``None`` for an
    exception that is not a Hub failure (a bug, an interrupt), which the caller re-raises as it is."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return _gated(request, _status(exc))
    if isinstance(exc, errors.RevisionNotFoundError):
        return ModelLoadError(
            f"{request.what} has no revision {request.revision!r} on the Hugging Face Hub: {request.revision_flag} "
            "takes a branch, a tag or a commit hash of the repository."
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ModelLoadError(
            f"{request.what} is not a local folder, and the Hugging Face Hub has no repository of that name (or it "
            "is private: set HF_TOKEN to a token that can read it)."
        )
    if isinstance(exc, errors.HfHubHTTPError):
        status = _status(exc)
        if status == 403:
            return _gated(request, status)
        return ModelLoadError(
            f"Downloading {request.what} from the Hugging Face Hub ({request.endpoint}) failed: it answered HTTP "
            f"{status}. Try again later, or pass a local model folder."
        )
    if request.offline and isinstance(exc, (errors.RevisionResolutionError, errors.LocalEntryNotFoundError)):
        return ModelLoadError(
            f"{request.what}{request.at_revision} is not a local folder and not (completely) in the Hugging Face "
            f"cache {request.cache_dir!r}, and HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE, or "
            "download it while online first."
        )
    if isinstance(exc, (errors.RevisionResolutionError, errors.LocalEntryNotFoundError)) or _is_transport_error(exc):
        return ModelLoadError(
            f"{request.what}{request.at_revision} is not a local folder, the Hugging Face Hub ({request.endpoint}) "
            f"cannot be reached to download it, and it is not (completely) in the cache {request.cache_dir!r}. "
            "Check the network (or HF_ENDPOINT), or pass a local model folder."
        )
    return None


def _gated(request: HubRequest, status: int | None) -> ModelLoadError:
    if status == 403:
        advice = "the token in HF_TOKEN has no access to it; request access on the model's Hub page"
    else:
        advice = "request access on the model's Hub page, then set HF_TOKEN to a token of an account that has it"
    return ModelLoadError(f"{request.what} is a gated repository on the Hugging Face Hub: {advice}.")


def _is_transport_error(exc: BaseException) -> bool:
    """A connection failure of the HTTP client (``httpx2`` under huggingface_hub 2, ``httpx`` under 1.x)."""
    return any(
        cls.__name__ == "TransportError" and cls.__module__.split(".")[0] in ("httpx", "httpx2")
        for cls in type(exc).__mro__
    )


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)
