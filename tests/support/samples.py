"""A sidecar's metrics as a test reads them: through prometheus-client's public
``get_sample_value`` on the sidecar's own registry, by the name ``/metrics`` shows."""

from __future__ import annotations

from sidecar.proxy.metrics import PREFIX
from sidecar.proxy.server import Sidecar


def sample(sc: Sidecar, name: str, **labels: str) -> float:
    """The value of sample ``llama_sidecar_<name>`` (a counter's name ends in ``_total``).

    A sample the registry does not hold fails the test rather than reading as 0: the
    sidecar pre-creates its bounded label sets, so a missing one is a wrong name.
    """
    full = f"{PREFIX}_{name}"
    value = sc.registry.get_sample_value(full, labels)
    assert value is not None, f"no sample {full}{labels or ''} in the sidecar's registry"
    return value
