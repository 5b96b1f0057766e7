"""Kafka transport shared by the library packages (collectors, streams, executors) and the
commands: client configuration (`KafkaConfig`, murmur2-partitioned producers) and topic
administration. It imports `schemas` and confluent-kafka, never the command layer (`xidstream`)."""
