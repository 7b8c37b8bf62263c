"""The kernel form a native call runs: a serving table's choice (cute_kernels.variants) whose
artifacts this build can load, picked once per call by the op's ``supports``.

Importing this module touches neither CUDA nor cutlass (the tables are plain Python).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional, Tuple, Union

from .. import _backend
from ..cute_kernels import variants
from . import cute_runtime

logger = logging.getLogger("msa")

TABLES = {"fmha": variants.FMHA_FORMS, "sparse": variants.SPARSE_FORMS,
          "indexer": variants.INDEXER_FORMS}
# Tables with a form not yet validated: only their calls read MSA_UNVALIDATED_KERNELS.
_GATED = {name for name, table in TABLES.items()
          if any(not form.validated for form in table.values())}


@functools.lru_cache(maxsize=4096)
def _table_choice(table: str, dtype: str, group: Optional[int], partial: Optional[str],
                  layout: Optional[str], unvalidated_ok: bool, forced: Optional[str],
                  exclude: Tuple[str, ...], features: tuple) -> Optional[variants.Form]:
    return variants.serving_form(TABLES[table], dtype, group=group, partial=partial,
                                 layout=layout, unvalidated_ok=unvalidated_ok, forced=forced,
                                 exclude=exclude, **dict(features))


def pick(table: str, dtype: str, artifacts: Callable[[variants.Form], Tuple[str, ...]], *,
         group: Optional[int] = None, partial: Optional[str] = None,
         layout: Optional[str] = None, forced: Optional[str] = None,
         **features) -> Union[variants.Form, str]:
    """The form of TABLES[table] serving a call (variants.serving_form over its dtype, head
    group, partial dtype, layout and features; `forced` is a debug hook's form), or the reason
    none can. A form whose artifacts (artifacts(form): variant names) can neither be loaded nor
    compiled here is passed by for the next one, with a warning once. Callers pass the features
    in one fixed order (they key a cache)."""
    key = tuple(features.items())
    unvalidated = table in _GATED and _backend.unvalidated_ok()
    exclude: Tuple[str, ...] = ()
    reason = None
    while True:
        form = _table_choice(table, dtype, group, partial, layout, unvalidated, forced, exclude,
                             key)
        if form is None:
            return reason or (f"no sm90 {table} kernel form is built for {dtype}"
                              f"{'' if group is None else f', G={group}'}"
                              f"{'' if partial is None else f', {partial} partials'} "
                              f"serving {dict(features)}")
        missing = cute_runtime.unavailable_reason(*artifacts(form))
        if missing is None:
            return form
        _warn_once(table, form.name, missing)
        reason = missing
        exclude += (form.name,)


@functools.lru_cache(maxsize=None)
def _warn_once(table: str, form: str, reason: str) -> None:
    logger.warning("msa: the %s kernel form %s cannot run here (%s); the next served form "
                   "takes its calls", table, form, reason)
