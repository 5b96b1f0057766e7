"""What NVIDIA's catalog says to do about a non-application Xid, as a remediation ladder.

- RESET_GPU, WORKFLOW_XID_48 and NVLink workflows: cordon, drain, reset the GPU; a failed reset
  climbs to a reboot, then a replacement.
- RESTART_BM / RESTART_VM (e.g. Xid 79, "fallen off the bus"): cordon, drain, reboot; if it recurs
  or the reboot fails, replace.
- CONTACT_SUPPORT and the rest: quarantine the GPU and recommend a support case.
- Xid 154 names its recovery action in its message; Xid 144-150 go through NVIDIA's "XID 144-150
  Decode" table (unit and error-status bits), falling back to the Fatal/Nonfatal word.
"""

from __future__ import annotations

import re

from xidstream.schemas.xid_catalog import NVLINK5_RULES, lookup

__all__ = ["Remedy", "remedy_for_xid", "decode_nvlink5", "RESET", "REBOOT", "QUARANTINE", "RECORD"]

RESET, REBOOT, QUARANTINE, RECORD = "reset", "reboot", "quarantine", "record"
Remedy = str  # one of the four above

_BY_RESOLUTION = {
    "RESET_GPU": RESET,
    "WORKFLOW_XID_48": RESET,
    "WORKFLOW_NVLINK_ERR": RESET,
    "WORKFLOW_NVLINK5_ERR": RESET,
    "RESTART_BM": REBOOT,
    "RESTART_VM": REBOOT,
    "IGNORE": RECORD,
    "RESTART_APP": RECORD,
    "XID_154_EVAL": RECORD,
}
_RANK = {RECORD: 0, QUARANTINE: 1, RESET: 2, REBOOT: 3}

# Xid 154 "GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)": the value after "to".
_XID154 = re.compile(r"to 0x([0-9a-fA-F]+)")
# nvmlDeviceGpuRecoveryAction_t (nvml.h): 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P,
# 4 drain and reset, 5 recover the IMEX domain (multi-node NVLink: no single-GPU rung fits, so
# quarantine and a support case), 6 bus reset (a reset of the GPU), 7 system reboot.
_XID154_ACTIONS = {0: RECORD, 1: RESET, 2: REBOOT, 3: QUARANTINE, 4: RESET, 5: QUARANTINE, 6: RESET, 7: REBOOT}

_NVL = re.compile(r"^\s*(?P<unit>[A-Z0-9_/]+)\s+(?P<sev>Fatal|Nonfatal|Non-fatal)?.*?\((?P<a>0x[0-9a-fA-F]+)\s+(?P<b>0x[0-9a-fA-F]+)")


def _bits_match(pattern: str, value: int) -> bool:
    if not pattern:
        return False
    width = len(pattern)
    for i, ch in enumerate(pattern):
        bit = (value >> (width - 1 - i)) & 1
        if ch in "01" and int(ch) != bit:
            return False
    return True


def decode_nvlink5(xid: int, message: str) -> tuple[str, str]:
    """(resolution, why) for an Xid 144-150 line, by NVIDIA's decode table."""
    m = _NVL.match(message or "")
    if not m:
        return ("RESET_GPU" if "Fatal" in (message or "") and "Nonfatal" not in message else "IGNORE",
                "no decodable unit/status; by the Fatal/Nonfatal word")
    unit, intr, status = m["unit"], int(m["a"], 16), int(m["b"], 16)
    best = None
    for rule in NVLINK5_RULES:
        if rule.xid != xid or unit not in rule.unit.split("/"):
            continue
        if not status & rule.error_status:
            continue
        if not (_bits_match(rule.intrinfo_pattern_v1, intr) or _bits_match(rule.intrinfo_pattern_v2, intr)):
            continue
        rank = _RANK.get(_BY_RESOLUTION.get(rule.resolution, QUARANTINE), 1)
        if best is None or rank > best[0]:
            best = (rank, rule)
    if best is not None:
        rule = best[1]
        return rule.resolution, f"NVLink5 decode: {rule.unit} status 0x{rule.error_status:08x} -> {rule.resolution} ({rule.severity})"
    sev = m["sev"] or ""
    return ("RESET_GPU" if sev == "Fatal" else "IGNORE",
            f"NVLink5 {unit}: no decode rule for status 0x{status:08x}; {sev or 'no severity'} -> "
            f"{'RESET_GPU' if sev == 'Fatal' else 'IGNORE'}")


def remedy_for_xid(xid: int, message: str = "") -> tuple[Remedy, str, str]:
    """(remedy, NVIDIA resolution, why) for a code that is not application-class."""
    info = lookup(xid)
    resolution = info.resolution
    why = f"NVIDIA catalog: Xid {xid} {info.name} -> {resolution}"
    if xid == 154:
        m = _XID154.search(message or "")
        if m:
            remedy = _XID154_ACTIONS.get(int(m.group(1), 16), QUARANTINE)
            return remedy, resolution, f"Xid 154: the driver's recovery action is now 0x{int(m.group(1), 16):x} ({remedy})"
        return QUARANTINE, resolution, "Xid 154 without a recovery action in its message"
    if 144 <= xid <= 150:
        resolution, why = decode_nvlink5(xid, message)
    return _BY_RESOLUTION.get(resolution, QUARANTINE), resolution, why
