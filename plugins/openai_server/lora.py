"""LoRA adapters behind ``vllite serve``: ``--lora-modules``, the served list, runtime loading and resolvers.

The server names each adapter it serves and gives it an id (1, 2, ... in the order they are loaded); a request
selects one with ``"model": "<adapter name>"``. Adapters come from ``--lora-modules`` at start-up, from
``POST /v1/load_lora_adapter`` and from the LoRA resolvers (``vllite_register_lora_resolvers``), the last two only
with ``VLLITE_ALLOW_RUNTIME_LORA_UPDATING=1`` (or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). Every load goes
through the engine's ``add_lora``, so an adapter that cannot run on this model (missing files, rank above
``--max-lora-rank``, a module the model lacks) is refused when it is loaded, with the engine's reason.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllite.exceptions import EngineClientClosedError, EngineDeadError
from vllite.lora import LoRARequest
from vllite.plugins.openai_server.http_errors import BadRequestError, LoRANotFoundError

logger = logging.getLogger("vllite.server")

#: The switch for runtime adapter updates (routes and resolvers); vLLM's name is read when vllite's is unset.
RUNTIME_UPDATING_ENVS = ("VLLITE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
#: The folder the builtin ``filesystem`` resolver looks in; vLLM's name is read when vllite's is unset.
RESOLVER_CACHE_DIR_ENVS = ("VLLITE_LORA_RESOLVER_CACHE_DIR", "VLLM_LORA_RESOLVER_CACHE_DIR")


def first_env(names: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """The value of the first of ``names`` that is set."""
    env = os.environ if env is None else env
    for name in names:
        if name in env:
            return env[name]
    return None


def runtime_updating_allowed(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``VLLITE_ALLOW_RUNTIME_LORA_UPDATING`` (else ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is 1 or true."""
    return (first_env(RUNTIME_UPDATING_ENVS, env) or "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` item (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(
    items: Sequence[str] | None, *, enable_lora: bool, served_model_names: Sequence[str] = ()
) -> tuple[LoRAModule, ...]:
    """``--lora-modules`` items, ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``; a
    ``ValueError`` naming the bad item (or the missing ``--enable-lora``, a name given twice or taken by a served
    model)."""
    modules: list[LoRAModule] = []
    for item in items or ():
        if not item:
            continue
        modules.append(_parse_item(item))
    if modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (LoRA adapters are off without it).")
    names = [module.name for module in modules]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {', '.join(map(repr, twice))} more than once.")
    taken = [name for name in names if name in served_model_names]
    if taken:
        raise ValueError(f"--lora-modules {taken[0]!r} is also a served model name; give the adapter another name.")
    return tuple(modules)


def _parse_item(item: str) -> LoRAModule:
    if "=" in item and "," not in item and not item.lstrip().startswith("{"):
        name, _, path = item.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH.")
        return LoRAModule(name, path)
    try:
        fields = json.loads(item)
    except json.JSONDecodeError:
        raise ValueError(
            f'--lora-modules {item!r}: expected NAME=PATH or JSON {{"name": ..., "path": ..., "base_model_name": ...}}.'
        ) from None
    if not isinstance(fields, dict):
        raise ValueError(f"--lora-modules {item!r}: the JSON form is an object with name, path, base_model_name.")
    unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
    if unknown:
        raise ValueError(f"--lora-modules {item!r}: unknown field(s) {', '.join(unknown)}.")
    lora_name, lora_path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
    if not isinstance(lora_name, str) or not lora_name or not isinstance(lora_path, str) or not lora_path:
        raise ValueError(f"--lora-modules {item!r}: 'name' and 'path' must be non-empty strings.")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules {item!r}: 'base_model_name' must be a string.")
    return LoRAModule(lora_name, lora_path, base)


def engine_message(exc: BaseException) -> str:
    """The engine's reason, without the RPC layer's ``Call to NAME method failed:`` prefix."""
    message = str(exc) or type(exc).__name__
    prefix, sep, rest = message.partition(" method failed: ")
    return rest if sep and prefix.startswith("Call to ") else message


class ServedLoRAs:
    """The adapters one server serves: ``name -> LoRARequest`` (``adapters``), loaded through the engine.

    ``base_model_name`` is what resolvers are given (the model as the engine loads it, as vLLM passes it);
    ``parent`` is the served name that ``/v1/models`` lists as each adapter's parent by default.
    """

    def __init__(
        self,
        engine: Any,
        served_model_names: Sequence[str],
        base_model_name: str,
        *,
        enabled: bool,
        max_loras: int = 0,
        runtime_updating: bool = False,
        resolvers: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.engine = engine
        self.served_model_names = tuple(served_model_names)
        self.parent = self.served_model_names[0]
        self.base_model_name = base_model_name
        self.enabled = enabled
        self.max_loras = max_loras
        self.runtime_updating = runtime_updating
        self.resolvers = list(resolvers)
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()  # one load or unload at a time: ids stay 1, 2, ... and checks stay true
        self._resolving: dict[str, _NameLock] = {}
        self._unloaded: set[str] = set()  # names unloaded before: their cached blocks must not serve a new adapter

    @classmethod
    def for_engine(cls, engine: Any, served_model_names: Sequence[str], base_model_name: str) -> ServedLoRAs:
        """The adapters of a server in front of ``engine``; the resolvers are built (so a broken one fails the
        start-up) when LoRA and runtime updates are both on."""
        lora_config = getattr(engine.config, "lora_config", None)
        runtime = runtime_updating_allowed()
        enabled = lora_config is not None
        resolvers = build_resolvers() if enabled and runtime else []
        max_loras = lora_config.max_loras if lora_config is not None else 0
        return cls(
            engine,
            served_model_names,
            base_model_name,
            enabled=enabled,
            max_loras=max_loras,
            runtime_updating=runtime,
            resolvers=resolvers,
        )

    # ------------------------------------------------------------------ what requests name
    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def parent_of(self, request: LoRARequest) -> str:
        return request.base_model_name or self.parent

    async def resolve(self, name: str) -> LoRARequest | None:
        """The adapter ``name`` names: a served one, else (runtime updates on) one a resolver finds, loaded now;
        ``None`` if there is none. ``BadRequestError`` when a resolver found it but it does not load."""
        found = self.adapters.get(name)
        if found is not None or not (self.enabled and self.runtime_updating and self.resolvers):
            return found
        entry = self._resolving.setdefault(name, _NameLock())
        entry.users += 1
        try:
            async with entry.lock:  # one resolution per name at a time; the others then find it served
                found = self.adapters.get(name)
                return found if found is not None else await self._ask_resolvers(name)
        finally:
            entry.users -= 1
            if not entry.users:
                del self._resolving[name]

    async def _ask_resolvers(self, name: str) -> LoRARequest | None:
        problems: list[str] = []
        for resolver_name, resolver in self.resolvers:
            try:
                result = await _call_resolver(resolver, self.base_model_name, name)
            except Exception as exc:
                logger.warning("LoRA resolver %r failed on %r: %s: %s", resolver_name, name, type(exc).__name__, exc)
                continue
            path = _resolved_path(result)
            if path is None:
                continue
            base = getattr(result, "base_model_name", None)
            try:
                request = await self.load(name, path, base if isinstance(base, str) else None)
            except BadRequestError as exc:
                logger.warning("LoRA adapter %r found by resolver %r does not load: %s", name, resolver_name, exc)
                problems.append(f"{resolver_name}: {exc}")
                continue
            logger.info("LoRA resolver %r resolved %r to %s", resolver_name, name, path)
            return request
        if problems:
            raise BadRequestError(
                f"LoRA adapter '{name}' was found but could not be loaded ({'; '.join(problems)}).", param="model"
            )
        return None

    # ------------------------------------------------------------------ loading and unloading
    async def load_static(self, modules: Sequence[LoRAModule]) -> None:
        """Loads the ``--lora-modules`` adapters at start-up; a ``ValueError`` naming the one that fails."""
        for module in modules:
            try:
                await self.load(module.name, module.path, module.base_model_name)
            except BadRequestError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc}") from None

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Loads adapter ``name`` from ``path`` in the engine and serves it under the next id.

        ``BadRequestError``: LoRA is off, the name is taken (a served model or adapter) or the engine cannot load
        the adapter (its reason)."""
        if not self.enabled:
            raise BadRequestError("LoRA adapters are off: start the server with --enable-lora.", param="lora_name")
        if not name:
            raise BadRequestError("lora_name must not be empty.", param="lora_name")
        if name in self.served_model_names:
            raise BadRequestError(
                f"'{name}' is the name of the served base model; give the adapter another name.", param="lora_name"
            )
        if not path:
            raise BadRequestError("lora_path must not be empty.", param="lora_path")
        async with self._lock:
            if name in self.adapters:
                raise BadRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            request = LoRARequest(name, self._next_id, path, base_model_name)
            try:
                await self.engine.add_lora(request)
            except (EngineDeadError, EngineClientClosedError):
                raise
            except Exception as exc:
                raise BadRequestError(engine_message(exc), param="lora_path") from None
            if name in self._unloaded:
                self._unloaded.discard(name)
                await self._forget_cached_blocks(name)
            self._next_id += 1
            self.adapters[name] = request
        logger.info("Loaded LoRA adapter %r (id %d) from %s", name, request.lora_int_id, path)
        return request

    async def unload(self, name: str) -> None:
        """Stops serving adapter ``name`` and unloads it from the engine. ``LoRANotFoundError`` for a name not
        served; ``BadRequestError`` while unfinished requests use it (they finish first; unload it then)."""
        async with self._lock:
            request = self.adapters.get(name)
            if request is None:
                raise LoRANotFoundError(name)
            users = self.requests_using(name)
            if users:
                raise BadRequestError(
                    f"The lora adapter '{name}' is in use by {users} unfinished request(s); unload it once they "
                    "finish.",
                    param="lora_name",
                )
            try:
                await self.engine.remove_lora(request.lora_int_id)
            except (EngineDeadError, EngineClientClosedError):
                raise
            except Exception as exc:
                raise BadRequestError(engine_message(exc), param="lora_name") from None
            del self.adapters[name]
            self._unloaded.add(name)
        logger.info("Unloaded LoRA adapter %r (id %d)", name, request.lora_int_id)

    async def _forget_cached_blocks(self, name: str) -> None:
        """The prefix cache keys blocks by adapter name: an adapter loaded again under a name unloaded before must
        not reuse the old one's blocks, so the cache is reset. Best effort: it cannot be while requests hold
        blocks."""
        try:
            reset = await self.engine.reset_prefix_cache()
        except Exception as exc:
            reset, reason = False, f"{type(exc).__name__}: {exc}"
        else:
            reason = "requests hold cached blocks"
        if not reset:
            logger.warning(
                "LoRA adapter %r is loaded again, but the prefix cache could not be reset (%s): it may reuse blocks "
                "cached for the adapter unloaded under that name until they are evicted.",
                name,
                reason,
            )

    # ------------------------------------------------------------------ requests in flight
    def _in_flight(self) -> list[Any]:
        processor = getattr(self.engine, "output_processor", None)
        return list(getattr(processor, "request_states", {}).values())

    def requests_using(self, name: str) -> int:
        """How many unfinished requests run with adapter ``name``."""
        return sum(1 for state in self._in_flight() if _lora_name(state) == name)

    def request_states(self) -> tuple[list[str], list[str]]:
        """``(waiting, running)`` adapter names of the requests in flight, as vLLM's ``LoRARequestStates``
        reports them: a request waits until it has produced output, then runs; each list is sorted."""
        waiting: set[str] = set()
        running: set[str] = set()
        for state in self._in_flight():
            name = _lora_name(state)
            if name is not None:
                (waiting if getattr(state, "is_prefilling", False) else running).add(name)
        return sorted(waiting), sorted(running)


class _NameLock:
    """The lock of one name being resolved, and how many requests wait on it (forgotten at zero)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


def _lora_name(state: Any) -> str | None:
    request = getattr(state, "lora_request", None)
    return request.lora_name if request is not None else None


async def _call_resolver(resolver: Any, base_model_name: str, lora_name: str) -> Any:
    """``resolver.resolve_lora(base, name)``: awaited when async (vLLM's), in a thread when not (it may download)."""
    method = resolver.resolve_lora
    if inspect.iscoroutinefunction(method):
        return await method(base_model_name, lora_name)
    result = await asyncio.to_thread(method, base_model_name, lora_name)
    return await result if inspect.isawaitable(result) else result


def _resolved_path(result: Any) -> str | None:
    """The adapter folder a resolver returned (a ``LoRARequest``, vLLM's included), or ``None`` for none."""
    if result is None:
        return None
    path = getattr(result, "lora_path", None) or getattr(result, "path", None)
    return str(path) if path else None


def build_resolvers() -> list[tuple[str, Any]]:
    """Every registered LoRA resolver as ``(name, instance)``, builtins first; a class is instantiated without
    arguments. A resolver that cannot be built fails the start-up, naming it."""
    from vllite.plugin_manager import get_registry

    registry = get_registry("lora_resolvers")
    resolvers = []
    for name in registry:
        resolver = registry[name]
        if isinstance(resolver, type):
            try:
                resolver = resolver()
            except Exception as exc:
                raise ValueError(f"LoRA resolver {name!r} cannot be built: {type(exc).__name__}: {exc}") from None
        resolvers.append((name, resolver))
    return resolvers


class FilesystemResolver:
    """The builtin ``filesystem`` LoRA resolver (vLLM's): adapter ``NAME`` is the folder ``DIR/NAME`` holding a
    LoRA ``adapter_config.json``, under ``DIR`` = ``$VLLITE_LORA_RESOLVER_CACHE_DIR`` (or vLLM's
    ``$VLLM_LORA_RESOLVER_CACHE_DIR``). Unset, it resolves nothing; set to something that is not a folder, the
    server does not start.

    Unlike vLLM's, it does not compare the adapter's ``base_model_name_or_path`` with the served model: the
    engine checks the adapter against the model when it loads it.
    """

    def __init__(self, cache_dir: str | None = None) -> None:
        cache_dir = cache_dir if cache_dir is not None else first_env(RESOLVER_CACHE_DIR_ENVS)
        if cache_dir and not os.path.isdir(cache_dir):
            raise ValueError(
                f"{RESOLVER_CACHE_DIR_ENVS[0]}={cache_dir!r} is not a folder (the filesystem LoRA resolver looks "
                "for adapters in DIR/NAME)."
            )
        self.cache_dir = cache_dir or None

    def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        if self.cache_dir is None or not lora_name or os.path.isabs(lora_name):
            return None
        root = os.path.abspath(self.cache_dir)
        path = os.path.abspath(os.path.join(root, lora_name))
        if path == root or os.path.commonpath([root, path]) != root:  # "..", an absolute name: not under DIR
            return None
        try:
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
            return None
        return LoRARequest(lora_name, 1, path)  # the server gives it its own id
