// Package ops holds the tests of what operators of the operator install and
// watch: the Helm chart and the install bundle (ops/install), the alerting
// rules and the dashboard (ops/monitoring). It is a module of its own so that
// Helm's and Prometheus' dependencies stay out of the main go.mod;
// `make test` runs it (`make test-ops`). go.work puts the main module in the
// same workspace, so a dependency added to the main go.mod needs no edit here.
package ops
