"""Executors: carry out signed, fresh remediation commands on the Kubernetes API
(`executors.cluster`) and on the node (`executors.node`), behind a pure gate (`executors.gate`),
and answer each on `gpu.remediation.results` (`executors.runner`)."""
