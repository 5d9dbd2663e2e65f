"""Manifests that lie (issue 29): built from a real entry's, so they reuse real block digests.

:func:`halved` is item 1's: every tensor half as wide as the real one, its blocks listed as
they are, so each block it names is good (its bytes hash to its name) and twice the size the
manifest gives it. :func:`publish` puts such a manifest on a remote with its markers, as a
writer with access to the bucket can.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvstore.catalog import keys as P
from kvstore.catalog.records import Records, records_of
from kvstore.schema import Manifest

replace = msgspec.structs.replace


def halved(m: Manifest, tokens: Sequence[int]) -> Manifest:
    """``m`` for ``tokens`` (as many as ``m`` has), each tensor's last axis halved: its
    token blocks are ``m``'s own digests, each claimed at half its real size."""
    assert len(tokens) == m.n_tokens

    def half(layer: Any) -> Any:
        return replace(layer, tensors=tuple(
            replace(t, shape=(*t.shape[:-1], t.shape[-1] // 2)) for t in layer.tensors))

    return replace(m, tokens=P.tokens_le(P.as_tokens(tokens)),
                   layers=tuple(half(x) for x in m.layers))


def publish(remote: Any, m: Manifest) -> Records:
    """Put ``m`` on the remote tier ``remote`` as a finished push would (manifest, markers,
    exact marker), uploading no block: it names blocks that are there."""
    rec = records_of(m)
    assert remote.catalog.commit(rec, lambda digests: None)
    return rec
