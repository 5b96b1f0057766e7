"""Exports for the SIEM and the data lake.

- `xidstream.exporters.ocsf`: alerts -> OCSF Detection Finding (2004) / Incident Finding (2005), commands and
  results -> Remediation Activity (7001); pure functions of one record.
- `xidstream.exporters.ecs`: the same as Elastic Common Schema documents; pure.
- `xidstream.exporters.parquet`: typed pyarrow schemas of the raw telemetry topics and an atomic,
  size- and time-rolled, Hive-partitioned Parquet writer.
- `xidstream.exporters.pipeline`: the Kafka loop (consumer group, offsets committed only after the output is
  durable) that the `xidstream export` command drives.

Imports schemas and transport only (never the command layer).
"""
