"""Executors: carry out signed, fresh remediation commands on the Kubernetes API
(`xidstream.executors.cluster`) and on the node (`xidstream.executors.node`), behind a pure gate (`xidstream.executors.gate`),
and answer each on `gpu.remediation.results` (`xidstream.executors.runner`)."""
