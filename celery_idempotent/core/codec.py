"""A result's stored form: kombu's serializers, loaded only from an accepted content type.

Results are encoded as Celery's result backend encodes them (``"json"``, ``"msgpack"``,
``"yaml"``, ``"pickle"``, or a serializer the application registered with kombu) and decoded
only when their content type is in an explicit accept list: JSON unless the user accepts more.
A result whose content type is not accepted (a pickle planted by whoever can write to the
store) raises :class:`~celery_idempotent.core.exceptions.RecordDecodeError` and is never
deserialized. The Redis store and the PostgreSQL backend both store results through a
:class:`ResultCodec`; each keeps its own record layout around the payload.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from celery_idempotent.core.exceptions import RecordDecodeError, ResultEncodeError

__all__ = ["ResultCodec", "SerializerInfo", "kombu_serialization", "serializer_info"]

_KOMBU: Any = None


def kombu_serialization() -> Any:
    """kombu's serialization module (typed loosely: kombu ships no type information),
    imported on first use: importing this module imports no kombu."""
    global _KOMBU  # noqa: PLW0603 - imported once, on first use (encode/decode are hot paths)
    if _KOMBU is None:
        import kombu.serialization  # noqa: PLC0415

        _KOMBU = kombu.serialization
    return _KOMBU


class SerializerInfo(NamedTuple):
    """What kombu registered under a serializer's name."""

    content_type: str
    content_encoding: str


def serializer_info(name: str | None) -> SerializerInfo | None:
    """The content type and encoding of kombu's serializer ``name``; ``None`` when kombu does
    not know it here."""
    codec = kombu_serialization().registry._encoders.get(name or "")
    return None if codec is None else SerializerInfo(codec.content_type, codec.content_encoding)


_JSON = "application/json"


def _fast_json() -> tuple[Any, Any]:
    """(kombu's JSON decoder, one that decodes the same): UTF-8 text, kombu's
    ``object_hook`` for its registered types, with the decoder object built once where
    ``kombu.utils.json.loads`` has ``json.loads`` build one per call. Used only while kombu's
    own is the registered one (an application may register its own JSON serializer)."""
    import json  # noqa: PLC0415 - with kombu, on first use

    from kombu.utils import json as kombu_json  # noqa: PLC0415

    decode = json.JSONDecoder(object_hook=kombu_json.object_hook).decode

    def loads(data: Any) -> Any:
        if isinstance(data, memoryview):
            data = data.tobytes()
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        if text.startswith("\ufeff"):  # what json.loads refuses before decoding
            raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig)")
        return decode(text)

    return kombu_json.loads, loads


def _fast_json_encoder(encoder: Any) -> Any:
    """``encoder`` itself, or for kombu's own JSON encoder one that encodes the same with its
    ``JSONEncoder`` built once (``kombu.utils.json.dumps`` has ``json.dumps`` build one per
    call, with every option at its default)."""
    from kombu.utils import json as kombu_json  # noqa: PLC0415 - with kombu, on first use

    if encoder is not kombu_json.dumps:
        return encoder
    return kombu_json.JSONEncoder().encode


class ResultCodec:
    """Encodes results with ``serializer`` and decodes those whose content type ``accept``
    allows (serializer names or content types; pickle only when named).

    Raises ``ValueError`` for an unknown serializer or accept entry, and for a serializer
    whose results ``accept`` would refuse to read back; ``TypeError`` for an ``accept`` that is
    not a list of names.
    """

    def __init__(self, serializer: str, accept: Iterable[str] | None) -> None:
        kombu = kombu_serialization()
        registry = kombu.registry
        if not isinstance(serializer, str) or serializer not in registry._encoders:
            known = ", ".join(sorted(registry._encoders))
            raise ValueError(f"serializer must be one of {known}, got {serializer!r}")
        if accept is None or isinstance(accept, str):
            raise TypeError(
                "accept must be a list of serializer names or content types (e.g. ['json']), "
                f"got {accept!r}"
            )
        try:
            self.accept: frozenset[str] = frozenset(kombu.prepare_accept_content(list(accept)))
        except Exception as exc:
            raise ValueError(f"accept names an unknown serializer: {accept!r} ({exc})") from exc
        self.serializer = serializer
        # kombu's codec for the serializer, and its decoders by content type: dumps and loads
        # call them directly (kombu's dumps/loads add lookups and a generator-based context
        # manager per call; the accept check they would do is done here, before decoding).
        self._codec = registry._encoders[serializer]
        self._encode = _fast_json_encoder(self._codec.encoder)
        self._decoders = registry._decoders
        self._json = _fast_json()
        self._kombu = kombu
        self.content_type: str = self._codec.content_type
        self.content_encoding: str = self._codec.content_encoding
        if self.content_type not in self.accept:
            raise ValueError(
                f"serializer {serializer!r} writes results that accept={list(accept)!r} would "
                "refuse to read back; add it to accept"
            )

    def binary_serializers(self) -> list[str]:
        """The names of the binary serializers this codec writes or reads (sorted): a store
        whose client decodes replies to text cannot carry their payloads."""
        return sorted(
            name
            for name, enc in self._kombu.registry._encoders.items()
            if enc.content_encoding == "binary"
            and (name == self.serializer or enc.content_type in self.accept)
        )

    def dumps(self, key: str, result: Any) -> bytes:
        """``result`` encoded; :class:`ResultEncodeError` when the serializer refuses it."""
        try:
            data = self._encode(result)
        except Exception as exc:
            raise ResultEncodeError(key, result, f"{self.serializer}: {exc}") from exc
        if isinstance(data, str):
            return data.encode("utf-8")
        return data if isinstance(data, bytes) else bytes(data)

    def loads(self, key: str, content_type: str | None, encoding: str | None, data: Any) -> Any:
        """The result stored as ``data`` with ``content_type`` and ``encoding``;
        :class:`RecordDecodeError` when the content type is not accepted (nothing is loaded)
        or the payload is corrupt."""
        content_type = content_type or ""
        if content_type not in self.accept:
            raise RecordDecodeError(
                key,
                content_type,
                f"stored result has content type {content_type!r}, which accept="
                f"{sorted(self.accept)} does not allow; it was not loaded",
            )
        try:
            decoder = self._decoders.get(content_type)
            if decoder is self._json[0] and content_type == _JSON:
                decoder = self._json[1]
            if decoder is not None and data:
                return decoder(data)
            # raw text or data, or an empty payload: kombu's rules for those
            return self._kombu.loads(data, content_type, encoding, accept=self.accept)
        except Exception as exc:
            raise RecordDecodeError(key, content_type, f"corrupt record: {exc}") from exc
