// Package controllers will hold the OutboxRelay reconciler, which turns an
// OutboxRelay into a Deployment of relay pods, a metrics Service and a PodDisruptionBudget.
package controllers
