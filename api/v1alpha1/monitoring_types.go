package v1alpha1

// MonitoringSpec asks for monitoring objects for the relay pods.
type MonitoringSpec struct {
	// PodMonitor, when true, makes the operator create a Prometheus Operator
	// PodMonitor (monitoring.coreos.com/v1) named <name>-relay that scrapes
	// the relay pods' metrics port, with the labels job="outbox-relay" and
	// outboxrelay=<name> that the shipped alerts and dashboard use. Without
	// the PodMonitor CRD in the cluster, the Monitoring condition says so and
	// the relay runs as usual. Default false.
	// +optional
	PodMonitor bool `json:"podMonitor,omitempty"`
}

// The Monitoring condition reports the PodMonitor spec.monitoring.podMonitor
// asks for; it is absent when none is asked for.
const (
	// ConditionMonitoring is True when the PodMonitor exists as the spec asks.
	ConditionMonitoring = "Monitoring"

	// ReasonPodMonitorReady: the PodMonitor exists as the spec asks.
	ReasonPodMonitorReady = "PodMonitorReady"
	// ReasonPodMonitorCRDMissing: the cluster serves no PodMonitor
	// (monitoring.coreos.com/v1); the Prometheus Operator is not installed.
	ReasonPodMonitorCRDMissing = "PodMonitorCRDMissing"
	// ReasonPodMonitorForbidden: the operator's role does not allow it to
	// write (or delete) the PodMonitor; its RBAC predates the field.
	ReasonPodMonitorForbidden = "PodMonitorForbidden"
	// ReasonPodMonitorRefused: the API server refused the PodMonitor's
	// write or delete for good (an admission policy or webhook, an invalid
	// field); the message carries its answer.
	ReasonPodMonitorRefused = "PodMonitorRefused"
)
