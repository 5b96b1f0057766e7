"""One valid record of every contract model, for round-trip and schema tests."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from xidstream.schemas import (
    Action,
    Alert,
    Approval,
    Classification,
    ComputeApp,
    DeadLetter,
    DeviceHolder,
    Evidence,
    EvidenceEntry,
    GpuCounters,
    GpuInventory,
    GpuProcesses,
    GpuSample,
    NodeEnrollment,
    NvLinkCounters,
    Outcome,
    PmonSample,
    Record,
    RemediationCommand,
    RemediationResult,
    RuleRef,
    SampleStatus,
    Severity,
    WorkloadEvent,
    WorkloadEventType,
    XidEvent,
    XidSource,
)

T0 = datetime(2026, 11, 28, 3, 0, 0, tzinfo=timezone.utc)
UUID1 = "GPU-5f0c3a8e-1b2d-4c6e-9a7f-0d1e2f3a4b5c"
NODE = "node-a"


def one_of_each(node: str = NODE, uuid: str = UUID1) -> list[Record]:
    pci = "0000:01:00"
    evidence = Evidence(
        node=node, gpu_uuid=uuid, gpu_index=1, pci_bus_id=pci,
        timeline=[EvidenceEntry(ts=T0, kind="xid", summary="Xid 43", data={"xid": 43, "pid": 4242})],
        sample_stats={"util_min": 100, "mem_max_mib": 0, "seconds": 120},
        xid_counts={"13": 1, "31": 1, "43": 1}, distinct_pids=[4242], pod_uids=["pod-1"],
    )
    return [
        GpuInventory(ts=T0, node=node, gpu_uuid=uuid, gpu_index=1, pci_bus_id=pci,
                     name="NVIDIA GeForce RTX 5090 D", serial="1650124014249", memory_total_mib=32607,
                     driver_version="590.44.01", cuda_version="13.1", memory_info_version=2),
        GpuSample(ts=T0, node=node, gpu_uuid=uuid, gpu_index=1, pci_bus_id=pci, utilization_gpu_pct=100,
                  utilization_memory_pct=0, memory_used_mib=0, memory_total_mib=32607, power_w=110.5,
                  sm_clock_mhz=2407, mem_clock_mhz=14001, temperature_c=48, status=SampleStatus.ok,
                  memory_reserved_mib=421.0, recovery_action=0, remapped_rows_correctable=0,
                  remapped_rows_uncorrectable=0, remapped_rows_pending=False, remapped_rows_failure=False,
                  ecc_dbe_volatile=0),
        GpuProcesses(ts=T0, node=node, gpu_uuid=uuid, gpu_index=1, pci_bus_id=pci,
                     compute_apps=[ComputeApp(pid=4242, process_name="python3", used_memory_mib=20480,
                                              pod_uid="pod-1", container_id="abc")],
                     pmon=[PmonSample(pid=4242, sm_util_pct=97, mem_util_pct=40)],
                     device_holders=[DeviceHolder(pid=77, process_name="dcgm-exporter")]),
        XidEvent(ts=T0, node=node, gpu_uuid=uuid, gpu_index=1, pci_bus_id=pci, resolved=True, xid=43,
                 xid_name="RESET_CHANNEL_VERIF_ERROR", pid=4242, process_name="python3",
                 message="Ch 00000008, intr 00000000", raw="NVRM: Xid (PCI:0000:01:00): 43, pid=4242, name=python3, Ch 00000008",
                 source=XidSource.kmsg, sources=[XidSource.kmsg, XidSource.nvml], ts_source="kmsg"),
        WorkloadEvent(ts=T0, node=node, gpu_uuid=uuid, pod_uid="pod-2", namespace="ml", pod="vllm-0",
                      container="vllm", event=WorkloadEventType.failed, reason="Error", exit_code=1),
        GpuCounters(ts=T0, node=node, gpu_uuid=uuid, gpu_index=1, pci_bus_id=pci,
                    nvlinks=[NvLinkCounters(link=0, active=True, replay_errors=2, recovery_errors=505,
                                            crc_flit_errors=7, crc_data_errors=None),
                             NvLinkCounters(link=1, active=False)],
                    pcie_replay_count=3, pcie_link_gen_current=4, pcie_link_gen_max=5, pcie_link_width_current=8,
                    pcie_link_width_max=16, ecc_corrected_volatile=12, ecc_uncorrected_volatile=0,
                    ecc_corrected_aggregate=340, ecc_uncorrected_aggregate=1, retired_pages_pending=False,
                    clock_event_reasons=0x48, clock_event_reason_names=["hw_slowdown", "hw_thermal_slowdown"],
                    temperature_c=87, fabric_cluster_uuid="5f0c3a8e-1b2d-4c6e-9a7f-0d1e2f3a4b5c", fabric_clique_id=32766,
                    fabric_state=3, fabric_status=0, fabric_health_mask=0,
                    unsupported=["retired_pages_single_bit", "retired_pages_double_bit", "nvlink_crc_data_errors"],
                    errors=1),
        Alert(ts=T0, node=node, alert_id="a1", incident_id="i1", gpu_uuid=uuid, pci_bus_id=pci,
              classification=Classification.GPU_WEDGED, severity=Severity.critical,
              summary="GPU 1 wedged after Xid 43", evidence=evidence,
              recommended_steps=["cordon node-a", "drain node-a", "nvidia-smi --gpu-reset -i 1"],
              rule=RuleRef(id="wedged.pinned_no_process_after_wedge_xid", name="wedged",
                           facts={"xid43": 1, "pinned_s": 60, "compute_processes": 0, "xids": [13, 43]})),
        RemediationCommand(ts=T0, node=node, command_id="c1", incident_id="i1", gpu_uuid=uuid, gpu_index=1,
                           action=Action.RESET_GPU, step=2, preconditions=["no process on the GPU"],
                           expires_at=T0 + timedelta(minutes=15), requires_approval=False, dry_run=True,
                           pci_bus_id=pci, evidence_ids=["e43", "s1"],
                           rule=RuleRef(id="wedged.pinned_no_process_after_wedge_xid", facts={"xid43": 1})),
        RemediationResult(ts=T0, node=node, command_id="c1", incident_id="i1", gpu_uuid=uuid, pci_bus_id=pci,
                          action=Action.RESET_GPU, outcome=Outcome.failed, detail="GPU busy"),
        Approval(ts=T0, node=node, approval_id="a1", command_id="c1", approved_by="alice", reason="storm reviewed",
                 expires_at=T0 + timedelta(hours=1)),
        DeadLetter(ts=T0, node=node, original=b"\x00\xffnot json", original_key=b"k",
                   source_topic="gpu.samples", source_partition=3, source_offset=42,
                   error="cannot decode record: not JSON", error_type="DecodeError"),
        NodeEnrollment(ts=T0, node=node, x25519_public="ab" * 32, ed25519_public="cd" * 32,
                       csr_name="xidstream-identity-node-a-0123456789", csr_uid="5e1f0a3c-0000-4000-8000-000000000001",
                       vouched="requested by system:serviceaccount:xidstream:xidstream-node from pod p on node node-a"),
    ]
