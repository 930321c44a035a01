"""Real servers (Kafka, Redis, NATS, Prometheus) on loopback for the integration tests."""
