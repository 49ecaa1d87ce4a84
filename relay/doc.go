// Package relay will hold the claim-publish-mark loop every relay pod runs:
// it moves committed outbox rows from PostgreSQL to Kafka, at least once.
package relay
