"""NVSwitch SXid codes: NVIDIA's name for each and the table it is in, for a few codes.

Source: NVIDIA Fabric Manager User Guide, DU-09883-001 v1.3 (October 2023), the appendix on NVSwitch
SXid errors (https://docs.nvidia.com/datacenter/tesla/pdf/fabric-manager-user-guide.pdf), as
gpud transcribes it per code and section (leptonai/gpud, components/accelerator/nvidia/sxid/sxid.go).
The guide's tables sort the codes into three classes, kept here as `fatality`:

- ``non_fatal`` ("Non-Fatal NVSwitch SXid Errors"): the switch goes on; some stall the NVLink
  traffic of the GPU behind the port;
- ``fatal`` ("Fatal NVSwitch SXid Errors"): fatal to the partitions that use the port; the guide
  says the error is propagated to the GPU as Xid 74 where it applies;
- ``always_fatal`` ("Always Fatal NVSwitch SXid Errors"): fatal to the whole fabric; the host is
  restarted.

Hand-kept, and short on purpose: the codes seen in real captures, and the always-fatal ones whose
transcription no other source contradicts (23001-23004 are left out: one public test names 23001
differently). A code not here is ``unknown`` (its record is kept, with the driver's own text in its
message). Each real SXid line also prints the driver's severity and the error's text after the code
(``20034, Fatal, Link 48 LTSSM Fault Up``); tests/schemas/test_sxid_catalog.py checks the names
against such lines. NVIDIA gives no Xid-style resolution bucket for SXids: the guide's recovery
steps depend on the virtualization model and on whether the port is an access or a trunk port.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["SxidInfo", "SXID_CATALOG", "FATALITIES", "lookup_sxid"]

FATALITIES = ("non_fatal", "fatal", "always_fatal")


class SxidInfo(NamedTuple):
    sxid: int
    name: str  # the guide's name of the error
    fatality: str  # FATALITIES, or "unknown"


SXID_CATALOG: dict[int, SxidInfo] = {
    info.sxid: info
    for info in (
        # Non-fatal
        SxidInfo(11004, "Ingress invalid ACL", "non_fatal"),
        SxidInfo(11012, "Single bit ECC errors", "non_fatal"),
        SxidInfo(12028, "egress nonposted PRIV error", "non_fatal"),
        SxidInfo(19084, "AN1 Heartbeat Timeout Error", "non_fatal"),
        # Fatal
        SxidInfo(20034, "LTSSM Fault Up", "fatal"),
        # listed as non-fatal and as fatal: the worse is kept
        SxidInfo(22012, "Minion Link NA interrupt", "fatal"),
        # Always fatal
        SxidInfo(12020, "egress sequence ID error", "always_fatal"),
        SxidInfo(22003, "Minion Halt", "always_fatal"),
        SxidInfo(22011, "Minion exterror", "always_fatal"),
    )
}


def lookup_sxid(code: int) -> SxidInfo:
    """The table's entry; a code it lacks passes through as ``unknown``."""
    return SXID_CATALOG.get(code) or SxidInfo(code, "unknown", "unknown")
