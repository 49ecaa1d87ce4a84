package controllers

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// manifest is a valid OutboxRelay as a user would write it; edit changes it.
func manifest(ns, name string, edit func(spec map[string]any)) *unstructured.Unstructured {
	spec := map[string]any{
		"dsnSecretRef": map[string]any{"name": "orders-dsn"},
		"table":        "outbox",
		"batchSize":    int64(50),
		"pollInterval": "200ms",
		"topics":       map[string]any{"OrderConfirmed": "orders.confirmed", "OrderCancelled": "orders.cancelled"},
		"kafka":        map[string]any{"brokers": []any{"kafka-0.kafka:9092"}},
	}
	if edit != nil {
		edit(spec)
	}
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "outbox.dev/v1alpha1",
		"kind":       "OutboxRelay",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       spec,
	}}
	return u
}

func kafka(spec map[string]any) map[string]any { return spec["kafka"].(map[string]any) }

// TestAPIServerRefusesInvalidManifests applies invalid OutboxRelays to the
// real API server: each is refused with a message naming the field.
func TestAPIServerRefusesInvalidManifests(t *testing.T) {
	c := adminClient(t)
	ns := newNamespace(t, c)
	long := strings.Repeat("t", 250)
	ident64 := strings.Repeat("a", 64)

	type invalidCase struct {
		name   string
		edit   func(spec map[string]any)
		fields []string // each must appear in the error
	}
	cases := []invalidCase{
		{"batchSize zero", func(s map[string]any) { s["batchSize"] = int64(0) }, []string{"spec.batchSize"}},
		{"template env sets the relay's own", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"env": []any{map[string]any{"name": "RELAY_BATCH_SIZE", "value": "1"}}}}
		}, []string{"spec.template.container.env[0].name", "RELAY_BATCH_SIZE: RELAY_* variables are the relay's own"}},
		{"template env name with =", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"env": []any{
				map[string]any{"name": "APP_MODE", "value": "1"}, map[string]any{"name": "JAVA_OPTS=-Xmx1g", "value": "1"}}}}
		}, []string{`spec.template.container.env[1].name: Invalid value: "JAVA_OPTS=-Xmx1g"`}},
		{"template env name empty", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"env": []any{map[string]any{"name": "", "value": "1"}}}}
		}, []string{`spec.template.container.env[0].name: Invalid value: ""`}},
		{"template envFrom prefix with =", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"envFrom": []any{
				map[string]any{"prefix": "CFG=", "configMapRef": map[string]any{"name": "app"}}}}}
		}, []string{`spec.template.container.envFrom[0].prefix: Invalid value: "CFG="`}},
		{"template env with value and valueFrom", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"env": []any{map[string]any{"name": "APP_MODE", "value": "1",
				"valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "metadata.name"}}}}}}
		}, []string{"spec.template.container.env[0]", "APP_MODE: value and valueFrom are exclusive"}},
		{"template envFrom without a source", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"envFrom": []any{map[string]any{"prefix": "CFG_"}}}}
		}, []string{"spec.template.container.envFrom[0]", "exactly one of configMapRef and secretRef"}},
		{"template envFrom with both sources", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"envFrom": []any{map[string]any{
				"configMapRef": map[string]any{"name": "app"}, "secretRef": map[string]any{"name": "app"}}}}}
		}, []string{"spec.template.container.envFrom[0]", "exactly one of configMapRef and secretRef"}},
		{"OAUTHBEARER without TLS", func(s map[string]any) {
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "oauth": map[string]any{"tokenFile": "/t"}}
		}, []string{"spec.kafka.sasl.mechanism", "OAUTHBEARER sends a bearer token in clear text"}},
		{"OAUTHBEARER without oauth", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER"}
		}, []string{"spec.kafka.sasl.oauth", "goes with mechanism OAUTHBEARER"}},
		{"OAUTHBEARER with both a file and an endpoint", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "credentialsSecretRef": map[string]any{"name": "c"},
				"oauth": map[string]any{"tokenFile": "/t", "tokenEndpoint": "https://idp/token"}}
		}, []string{"spec.kafka.sasl.oauth", "exactly one of tokenFile and tokenEndpoint"}},
		{"OAUTHBEARER endpoint in clear text", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "credentialsSecretRef": map[string]any{"name": "c"},
				"oauth": map[string]any{"tokenEndpoint": "http://idp.example/token"}}
		}, []string{"spec.kafka.sasl.oauth.tokenEndpoint", "the client secret never crosses the network in clear text"}},
		{"OAUTHBEARER endpoint without client credentials", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "oauth": map[string]any{"tokenEndpoint": "https://idp/token"}}
		}, []string{"spec.kafka.sasl.credentialsSecretRef", "oauth.tokenEndpoint needs credentialsSecretRef"}},
		{"SCRAM without credentials", func(s map[string]any) {
			kafka(s)["sasl"] = map[string]any{"mechanism": "SCRAM-SHA-512"}
		}, []string{"spec.kafka.sasl.credentialsSecretRef", "PLAIN and SCRAM need credentialsSecretRef"}},
		{"aws settings with SCRAM", func(s map[string]any) {
			kafka(s)["sasl"] = map[string]any{"mechanism": "SCRAM-SHA-512", "credentialsSecretRef": map[string]any{"name": "c"}, "aws": map[string]any{"region": "eu-west-1"}}
		}, []string{"spec.kafka.sasl.aws", "applies only to mechanism AWS_MSK_IAM"}},
		{"AWS_MSK_IAM without TLS", func(s map[string]any) {
			kafka(s)["sasl"] = map[string]any{"mechanism": "AWS_MSK_IAM"}
		}, []string{"spec.kafka.sasl.mechanism", "MSK serves AWS_MSK_IAM only over TLS"}},
		{"logical replication with partition-key ordering", func(s map[string]any) {
			s["capture"] = map[string]any{"mode": "LogicalReplication"}
			s["ordering"] = "PartitionKey"
		}, []string{"spec.capture.mode", "does not combine with spec.ordering PartitionKey"}},
		{"writer deletes with autoscaling", func(s map[string]any) {
			s["capture"] = map[string]any{"mode": "LogicalReplication", "writerDeletes": true}
			s["autoscaling"] = map[string]any{"maxReplicas": int64(2)}
		}, []string{"spec.autoscaling", "does not combine with spec.capture.writerDeletes"}},
		{"writer deletes while polling", func(s map[string]any) {
			s["capture"] = map[string]any{"writerDeletes": true}
		}, []string{"spec.capture", "writerDeletes needs spec.capture.mode LogicalReplication"}},
		{"retained WAL below 64Mi", func(s map[string]any) {
			s["capture"] = map[string]any{"mode": "LogicalReplication", "maxRetainedWAL": "10Mi"}
		}, []string{"spec.capture.maxRetainedWAL", "at least 64Mi"}},
		{"partition column not an identifier", func(s map[string]any) { s["partitionColumn"] = "Kafka Partition" }, []string{"spec.partitionColumn"}},
		{"database auth method unknown", func(s map[string]any) {
			s["database"] = map[string]any{"auth": map[string]any{"method": "Kerberos"}}
		}, []string{"spec.database.auth.method", "Kerberos"}},
		{"database auth aws settings without its method", func(s map[string]any) {
			s["database"] = map[string]any{"auth": map[string]any{"method": "AzureAD", "aws": map[string]any{"region": "eu-west-1"}}}
		}, []string{"spec.database.auth.aws", "applies only to method AWSRDSIAM"}},
		{"database auth aws region malformed", func(s map[string]any) {
			s["database"] = map[string]any{"auth": map[string]any{"method": "AWSRDSIAM", "aws": map[string]any{"region": "EU West"}}}
		}, []string{"spec.database.auth.aws.region"}},
		{"template volume takes the relay's name", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"volumes": []any{map[string]any{"name": "kafka-tls", "emptyDir": map[string]any{}}}}}
		}, []string{"spec.template.pod.volumes", "kafka-tls and database-tls are the relay's own"}},
		{"template mount at a relative path", func(s map[string]any) {
			s["template"] = map[string]any{
				"pod":       map[string]any{"volumes": []any{map[string]any{"name": "bin", "configMap": map[string]any{"name": "bin", "defaultMode": int64(0o755)}}}},
				"container": map[string]any{"volumeMounts": []any{map[string]any{"name": "bin", "mountPath": "relay", "subPath": "relay"}}}}
		}, []string{"spec.template.container.volumeMounts[0]", "mountPath relay must be absolute"}},
		{"template mount under the relay's directory", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"volumeMounts": []any{map[string]any{"name": "ca", "mountPath": "/etc/relay/tls"}}}}
		}, []string{"spec.template.container.volumeMounts[0]", "volume ca at /etc/relay/tls: ", "the directory /etc/relay"}},
		{"template volume of two kinds", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"volumes": []any{map[string]any{"name": "x", "emptyDir": map[string]any{},
				"secret": map[string]any{"secretName": "s"}}}}}
		}, []string{"spec.template.pod.volumes[0]", "exactly one of secret, configMap, projected, emptyDir and csi"}},
		{"template container privileged", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{"privileged": true}}}
		}, []string{"spec.template.container.securityContext", "privileged: true breaks Pod Security restricted"}},
		{"template container escalates", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{"allowPrivilegeEscalation": true}}}
		}, []string{"spec.template.container.securityContext", "allowPrivilegeEscalation: true"}},
		{"template container adds a capability", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{
				"capabilities": map[string]any{"add": []any{"NET_BIND_SERVICE", "NET_ADMIN"}}}}}
		}, []string{"spec.template.container.securityContext", "capabilities.add"}},
		{"template container as root", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{"runAsUser": int64(0)}}}
		}, []string{"spec.template.container.securityContext", "runAsUser: 0 (root)"}},
		{"template container unconfined", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{
				"seccompProfile": map[string]any{"type": "Unconfined"}}}}
		}, []string{"spec.template.container.securityContext", "seccompProfile Unconfined"}},
		{"template container unmasked proc", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{"procMount": "Unmasked"}}}
		}, []string{"spec.template.container.securityContext", "procMount"}},
		{"template container drops a capability, not all", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{
				"capabilities": map[string]any{"drop": []any{"NET_RAW"}}}}}
		}, []string{"spec.template.container.securityContext", "capabilities.drop must include ALL"}},
		{"template container apparmor unconfined", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{
				"appArmorProfile": map[string]any{"type": "Unconfined"}}}}
		}, []string{"spec.template.container.securityContext", "appArmorProfile Unconfined"}},
		{"template container selinux user", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{
				"seLinuxOptions": map[string]any{"user": "system_u"}}}}
		}, []string{"spec.template.container.securityContext", "seLinuxOptions"}},
		{"template container host process", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"securityContext": map[string]any{
				"windowsOptions": map[string]any{"hostProcess": true}}}}
		}, []string{"spec.template.container.securityContext", "windowsOptions.hostProcess"}},
		{"template pod apparmor unconfined", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"securityContext": map[string]any{
				"appArmorProfile": map[string]any{"type": "Unconfined"}}}}
		}, []string{"spec.template.pod.securityContext", "appArmorProfile Unconfined"}},
		{"template pod selinux type spc_t", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"securityContext": map[string]any{
				"seLinuxOptions": map[string]any{"type": "spc_t"}}}}
		}, []string{"spec.template.pod.securityContext", "seLinuxOptions"}},
		{"template pod host process", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"securityContext": map[string]any{
				"windowsOptions": map[string]any{"hostProcess": true}}}}
		}, []string{"spec.template.pod.securityContext", "windowsOptions.hostProcess"}},
		{"template pod may run as root", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"securityContext": map[string]any{"runAsNonRoot": false}}}
		}, []string{"spec.template.pod.securityContext", "runAsNonRoot: false"}},
		{"template pod as root", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"securityContext": map[string]any{"runAsUser": int64(0)}}}
		}, []string{"spec.template.pod.securityContext", "runAsUser: 0 (root)"}},
		{"template volume of no kind", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"volumes": []any{map[string]any{"name": "x"}}}}
		}, []string{"spec.template.pod.volumes[0]", "exactly one of"}},
		{"autoscaling maxReplicas below minReplicas", func(s map[string]any) {
			s["autoscaling"] = map[string]any{"minReplicas": int64(3), "maxReplicas": int64(2), "pendingPerReplica": int64(100)}
		}, []string{"spec.autoscaling.maxReplicas", "must be at least minReplicas"}},
		{"autoscaling maxReplicas below the default minReplicas", func(s map[string]any) {
			s["autoscaling"] = map[string]any{"maxReplicas": int64(0), "pendingPerReplica": int64(100)}
		}, []string{"spec.autoscaling.maxReplicas"}},
		{"autoscaling without a target", func(s map[string]any) {
			s["autoscaling"] = map[string]any{"maxReplicas": int64(3)}
		}, []string{"spec.autoscaling", "needs a target"}},
		{"autoscaling oldestAge below 1s", func(s map[string]any) {
			s["autoscaling"] = map[string]any{"maxReplicas": int64(3), "oldestAge": "500ms"}
		}, []string{"spec.autoscaling.oldestAge: 500ms is not a duration between 1s and 24h"}},
		{"autoscaling scaleDownStabilization above 1h", func(s map[string]any) {
			s["autoscaling"] = map[string]any{"maxReplicas": int64(3), "pendingPerReplica": int64(1), "scaleDownStabilization": "61m"}
		}, []string{"spec.autoscaling.scaleDownStabilization: 61m is not a duration"}},
		{"autoscaling minReplicas negative", func(s map[string]any) {
			s["autoscaling"] = map[string]any{"minReplicas": int64(-1), "maxReplicas": int64(3), "pendingPerReplica": int64(1)}
		}, []string{"spec.autoscaling.minReplicas"}},
		{"backlog interval below 5s", func(s map[string]any) { s["backlog"] = map[string]any{"interval": "4s"} }, []string{"spec.backlog.interval: 4s is not a duration"}},
		{"lagThreshold above 24h", func(s map[string]any) { s["lagThreshold"] = "25h" }, []string{"spec.lagThreshold: 25h is not a duration between 1s and 24h"}},
		{"lagThreshold not a duration", func(s map[string]any) { s["lagThreshold"] = "1 minute" }, []string{"spec.lagThreshold"}},
		{"batchSize above 10000", func(s map[string]any) { s["batchSize"] = int64(10001) }, []string{"spec.batchSize"}},
		{"pollInterval below 10ms", func(s map[string]any) { s["pollInterval"] = "9ms" }, []string{"spec.pollInterval: 9ms is not a duration"}},
		{"pollInterval above 1h", func(s map[string]any) { s["pollInterval"] = "61m" }, []string{"spec.pollInterval: 61m is not a duration"}},
		{"pollInterval not a duration", func(s map[string]any) { s["pollInterval"] = "soon" }, []string{"spec.pollInterval"}},
		{"pollInterval without unit", func(s map[string]any) { s["pollInterval"] = "200" }, []string{"spec.pollInterval"}},
		{"linger below 1ms", func(s map[string]any) { s["linger"] = "500us" }, []string{"spec.linger: 500us is not a duration between 1ms and 1s"}},
		{"linger above 1s", func(s map[string]any) { s["linger"] = "2s" }, []string{"spec.linger: 2s is not a duration"}},
		{"topics empty", func(s map[string]any) { s["topics"] = map[string]any{} }, []string{"spec.topics"}},
		{"topics missing", func(s map[string]any) { delete(s, "topics") }, []string{"spec.topics"}},
		{"event type empty", func(s map[string]any) { s["topics"] = map[string]any{"": "orders"} }, []string{"spec.topics"}},
		{"event type with =", func(s map[string]any) { s["topics"] = map[string]any{"a=b": "orders"} }, []string{"spec.topics"}},
		{"event type with surrounding whitespace, among valid ones", func(s map[string]any) {
			s["topics"] = map[string]any{"OrderPlaced": "orders", "Order Created ": "orders", "OrderShipped": "orders"}
		}, []string{"spec.topics", `event type "Order Created " must be`}},
		{"event type of 300 characters", func(s map[string]any) { s["topics"] = map[string]any{strings.Repeat("e", 300): "orders"} },
			[]string{"spec.topics", `event type "` + strings.Repeat("e", 64) + `..." must be`}},
		{"topic with a space", func(s map[string]any) { s["topics"] = map[string]any{"OrderConfirmed": "orders confirmed"} }, []string{"spec.topics"}},
		{"topic ..", func(s map[string]any) { s["topics"] = map[string]any{"OrderConfirmed": ".."} }, []string{"spec.topics"}},
		{"topic .", func(s map[string]any) { s["topics"] = map[string]any{"OrderConfirmed": "."} }, []string{"spec.topics"}},
		{"topic of 250 characters", func(s map[string]any) { s["topics"] = map[string]any{"OrderConfirmed": long} }, []string{"spec.topics"}},
		{"topic empty", func(s map[string]any) { s["topics"] = map[string]any{"OrderConfirmed": ""} }, []string{"spec.topics"}},
		{"deadLetterTopic is a mapped topic", func(s map[string]any) { s["deadLetterTopic"] = "orders.cancelled" }, []string{"spec.deadLetterTopic"}},
		{"deadLetterTopic invalid name", func(s map[string]any) { s["deadLetterTopic"] = "dead/letter" }, []string{"spec.deadLetterTopic"}},
		{"table with SQL", func(s map[string]any) { s["table"] = "outbox; DROP TABLE orders" }, []string{"spec.table"}},
		{"table quoted", func(s map[string]any) { s["table"] = `"Outbox"` }, []string{"spec.table"}},
		{"table three parts", func(s map[string]any) { s["table"] = "db.public.outbox" }, []string{"spec.table"}},
		{"table identifier of 64 characters", func(s map[string]any) { s["table"] = "public." + ident64 }, []string{"spec.table"}},
		{"table starting with a digit", func(s map[string]any) { s["table"] = "1outbox" }, []string{"spec.table"}},
		{"table in upper case", func(s map[string]any) { s["table"] = "events.Outbox_2" }, []string{"spec.table"}},
		{"table that is its own held table", func(s map[string]any) { s["table"] = "app." + strings.Repeat("o", 58) + "_held" }, []string{"spec.table: a name of 63 characters ending in _held"}},
		{"table that is its own event id table", func(s map[string]any) { s["table"] = strings.Repeat("o", 53) + "_event_ids" }, []string{"its own held or event id table"}},
		{"maxBatchBytes below 64 KiB", func(s map[string]any) { s["maxBatchBytes"] = int64(65535) }, []string{"spec.maxBatchBytes"}},
		{"maxBatchBytes above 64 MiB", func(s map[string]any) { s["maxBatchBytes"] = int64(67108865) }, []string{"spec.maxBatchBytes"}},
		{"event type with a leading space", func(s map[string]any) { s["topics"] = map[string]any{" OrderConfirmed": "orders"} }, []string{"spec.topics"}},
		{"SASL PLAIN without TLS", func(s map[string]any) {
			kafka(s)["sasl"] = map[string]any{"mechanism": "PLAIN", "credentialsSecretRef": map[string]any{"name": "kafka-user"}}
		}, []string{"spec.kafka.sasl.mechanism", "spec.kafka.tls"}},
		{"dsnSecretRef missing", func(s map[string]any) { delete(s, "dsnSecretRef") }, []string{"spec.dsnSecretRef"}},
		{"dsnSecretRef without name", func(s map[string]any) { s["dsnSecretRef"] = map[string]any{"key": "dsn"} }, []string{"spec.dsnSecretRef.name"}},
		{"dsnSecretRef name not a Secret name", func(s map[string]any) { s["dsnSecretRef"] = map[string]any{"name": "Orders_DSN"} }, []string{"spec.dsnSecretRef.name"}},
		{"kafka missing", func(s map[string]any) { delete(s, "kafka") }, []string{"spec.kafka"}},
		{"no brokers", func(s map[string]any) { kafka(s)["brokers"] = []any{} }, []string{"spec.kafka.brokers"}},
		{"broker without port", func(s map[string]any) { kafka(s)["brokers"] = []any{"kafka-0"} }, []string{"spec.kafka.brokers[0]"}},
		{"broker port above 65535", func(s map[string]any) { kafka(s)["brokers"] = []any{"kafka-0:9092", "kafka-1:99999"} }, []string{"spec.kafka.brokers[1]", "65535"}},
		{"broker port zero", func(s map[string]any) { kafka(s)["brokers"] = []any{"kafka-0:0"} }, []string{"spec.kafka.brokers[0]"}},
		{"broker URL", func(s map[string]any) { kafka(s)["brokers"] = []any{"tcp://kafka-0:9092"} }, []string{"spec.kafka.brokers[0]"}},
		{"replicas negative", func(s map[string]any) { s["replicas"] = int64(-1) }, []string{"spec.replicas"}},
		{"ordering unknown", func(s map[string]any) { s["ordering"] = "Strict" }, []string{"spec.ordering"}},
		{"SASL mechanism unknown", func(s map[string]any) {
			kafka(s)["sasl"] = map[string]any{"mechanism": "GSSAPI", "credentialsSecretRef": map[string]any{"name": "kafka-user"}}
		}, []string{"spec.kafka.sasl.mechanism"}},
		{"SASL without credentials", func(s map[string]any) { kafka(s)["sasl"] = map[string]any{"mechanism": "PLAIN"} }, []string{"spec.kafka.sasl.credentialsSecretRef"}},
		{"TLS secret name invalid", func(s map[string]any) { kafka(s)["tls"] = map[string]any{"secretRef": map[string]any{"name": "-tls"}} }, []string{"spec.kafka.tls.secretRef.name"}},
		{"imagePullPolicy unknown", func(s map[string]any) { s["imagePullPolicy"] = "Sometimes" }, []string{"spec.imagePullPolicy"}},
		{"cloudEventsSource with a space", func(s map[string]any) { s["cloudEventsSource"] = "/outbox/my orders" }, []string{"spec.cloudEventsSource"}},
		{"cloudEventsSource with a broken escape", func(s map[string]any) { s["cloudEventsSource"] = "/outbox/%zz" }, []string{"spec.cloudEventsSource"}},
		{"cloudEventsSource with a colon but no scheme", func(s map[string]any) { s["cloudEventsSource"] = "1orders:outbox" },
			[]string{"spec.cloudEventsSource", "needs a scheme before it"}},
		{"cloudEventsSource with a port that is not a number", func(s map[string]any) { s["cloudEventsSource"] = "https://orders.example:https/outbox" },
			[]string{"spec.cloudEventsSource", "[user@]host[:port]"}},
		{"OAUTHBEARER endpoint without a host", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "credentialsSecretRef": map[string]any{"name": "c"},
				"oauth": map[string]any{"tokenEndpoint": "https:///token"}}
		}, []string{"spec.kafka.sasl.oauth.tokenEndpoint", "an https URL with a host"}},
		{"serviceAccountName not a name", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"serviceAccountName": "Orders_Relay"}}
		}, []string{"spec.template.pod.serviceAccountName"}},
		{"priorityClassName not a name", func(s map[string]any) { s["priorityClassName"] = "High Priority" }, []string{"spec.priorityClassName"}},
		{"a request above its limit", func(s map[string]any) {
			s["resources"] = map[string]any{"requests": map[string]any{"memory": "512Mi", "cpu": "100m"}, "limits": map[string]any{"memory": "256Mi"}}
		}, []string{"spec.resources", "a request exceeds its limit"}},
		{"retained WAL above 1Pi", func(s map[string]any) {
			s["capture"] = map[string]any{"mode": "LogicalReplication", "maxRetainedWAL": "2Pi"}
		}, []string{"spec.capture.maxRetainedWAL", "at most 1Pi"}},
		{"several fields at once", func(s map[string]any) {
			s["batchSize"] = int64(0)
			s["table"] = "x y"
			kafka(s)["brokers"] = []any{"kafka"}
		}, []string{"spec.batchSize", "spec.table", "spec.kafka.brokers[0]"}},
	}
	for _, c := range []struct{ name, mount string }{
		{"template mount over the relay's binary", "/relay"},
		{"template mount over the root", "/"},
	} {
		cases = append(cases, invalidCase{c.name, func(s map[string]any) {
			s["template"] = map[string]any{
				"pod":       map[string]any{"volumes": []any{map[string]any{"name": "bin", "configMap": map[string]any{"name": "bin", "defaultMode": int64(0o755)}}}},
				"container": map[string]any{"volumeMounts": []any{map[string]any{"name": "bin", "mountPath": c.mount, "subPath": "relay"}}}}
		}, []string{"spec.template.container.volumeMounts[0]", "volume bin at " + c.mount + ": ", "the relay's binary /relay are the relay's own"}})
	}
	// Every label the operator selects the relay pods by, in both places
	// that add labels; the operator's own annotation in both that add
	// annotations. Before, the API took them and the reconcile refused.
	relay, _ := minimalRelay(ns, "labels")
	for k := range commonLabels(relay) {
		cases = append(cases, invalidCase{"podLabels " + k, func(s map[string]any) { s["podLabels"] = map[string]any{k: "x", "team": "orders"} },
			[]string{"spec.podLabels", "must not set " + k}},
			invalidCase{"template labels " + k, func(s map[string]any) {
				s["template"] = map[string]any{"metadata": map[string]any{"labels": map[string]any{k: "x"}}}
			}, []string{"spec.template.metadata.labels", "must not set " + k}})
	}
	cases = append(cases, invalidCase{"podAnnotations config hash", func(s map[string]any) { s["podAnnotations"] = map[string]any{configHashAnnotation: "x"} },
		[]string{"spec.podAnnotations", "must not set " + configHashAnnotation}},
		invalidCase{"template annotations config hash", func(s map[string]any) {
			s["template"] = map[string]any{"metadata": map[string]any{"annotations": map[string]any{configHashAnnotation: "x"}}}
		}, []string{"spec.template.metadata.annotations", "must not set " + configHashAnnotation}},
		// The API server refuses a pod whose legacy seccomp annotation
		// differs from the seccompProfile the operator sets; before, the
		// OutboxRelay was taken and its Deployment refused.
		invalidCase{"podAnnotations legacy seccomp", func(s map[string]any) {
			s["podAnnotations"] = map[string]any{"team": "orders", "seccomp.security.alpha.kubernetes.io/pod": "unconfined"}
		}, []string{"spec.podAnnotations", "must not set seccomp.security.alpha.kubernetes.io/pod", "spec.template.pod.securityContext.seccompProfile"}},
		invalidCase{"template annotations legacy container seccomp", func(s map[string]any) {
			s["template"] = map[string]any{"metadata": map[string]any{"annotations": map[string]any{"container.seccomp.security.alpha.kubernetes.io/relay": "localhost/profile.json"}}}
		}, []string{"spec.template.metadata.annotations", "must not set container.seccomp.security.alpha.kubernetes.io/relay to other than runtime/default"}},
		invalidCase{"podAnnotations apparmor unconfined", func(s map[string]any) {
			s["podAnnotations"] = map[string]any{"container.apparmor.security.beta.kubernetes.io/relay": "unconfined"}
		}, []string{"spec.podAnnotations", "must not set container.apparmor.security.beta.kubernetes.io/relay: unconfined breaks Pod Security restricted"}},
		invalidCase{"template annotations apparmor unconfined", func(s map[string]any) {
			s["template"] = map[string]any{"metadata": map[string]any{"annotations": map[string]any{"container.apparmor.security.beta.kubernetes.io/relay": "unconfined"}}}
		}, []string{"spec.template.metadata.annotations", "must not set container.apparmor.security.beta.kubernetes.io/relay"}},
		invalidCase{"partition column the relay reads", func(s map[string]any) { s["partitionColumn"] = "published_at" },
			[]string{"spec.partitionColumn: published_at is a column the relay reads for its own purpose"}})
	require.GreaterOrEqual(t, len(cases), 15)
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := c.Create(context.Background(), manifest(ns, fmt.Sprintf("invalid-%d", i), tc.edit))
			require.Error(t, err, "the API server accepted an invalid manifest")
			t.Log(err)
			require.True(t, apierrors.IsInvalid(err), "want 422 Invalid, got %v", err)
			for _, f := range tc.fields {
				require.ErrorContains(t, err, f)
			}
		})
	}

	t.Run("metadata.name longer than 57 characters", func(t *testing.T) {
		t.Parallel()
		err := c.Create(context.Background(), manifest(ns, strings.Repeat("n", 58), nil))
		require.True(t, apierrors.IsInvalid(err), "want 422 Invalid, got %v", err)
		require.ErrorContains(t, err, "metadata.name")
	})
	t.Run("metadata.name starting with a digit", func(t *testing.T) {
		t.Parallel()
		err := c.Create(context.Background(), manifest(ns, "1orders", nil))
		require.True(t, apierrors.IsInvalid(err), "want 422 Invalid, got %v", err)
		require.ErrorContains(t, err, "metadata.name")
	})
}

// TestAPIServerAcceptsEdgeCases applies valid OutboxRelays at the edges of
// every rule; the API server must accept them all.
func TestAPIServerAcceptsEdgeCases(t *testing.T) {
	c := adminClient(t)
	ns := newNamespace(t, c)
	cases := []struct {
		name string
		edit func(spec map[string]any)
	}{
		{"batchSize 1", func(s map[string]any) { s["batchSize"] = int64(1) }},
		{"legacy seccomp annotation runtime/default, as the operator's", func(s map[string]any) {
			s["podAnnotations"] = map[string]any{"seccomp.security.alpha.kubernetes.io/pod": "runtime/default"}
		}},
		{"apparmor annotation runtime/default", func(s map[string]any) {
			s["podAnnotations"] = map[string]any{"container.apparmor.security.beta.kubernetes.io/relay": "runtime/default"}
		}},
		{"batchSize 10000", func(s map[string]any) { s["batchSize"] = int64(10000) }},
		{"pollInterval 10ms", func(s map[string]any) { s["pollInterval"] = "10ms" }},
		{"pollInterval 1h", func(s map[string]any) { s["pollInterval"] = "1h" }},
		{"pollInterval 0.5s", func(s map[string]any) { s["pollInterval"] = "0.5s" }},
		{"pollInterval 1m30s", func(s map[string]any) { s["pollInterval"] = "1m30s" }},
		{"linger 1ms", func(s map[string]any) { s["linger"] = "1ms" }},
		{"linger 1s", func(s map[string]any) { s["linger"] = "1s" }},
		{"topic of 249 characters", func(s map[string]any) { s["topics"] = map[string]any{"A": strings.Repeat("t", 249)} }},
		{"topic ... and _-", func(s map[string]any) { s["topics"] = map[string]any{"A": "...", "B": "a_b-c.D9"} }},
		{"event type with dots and colons", func(s map[string]any) { s["topics"] = map[string]any{"com.example:Order.Confirmed": "orders"} }},
		{"deadLetterTopic distinct", func(s map[string]any) { s["deadLetterTopic"] = "orders.dlq" }},
		{"table schema-qualified", func(s map[string]any) { s["table"] = "events.outbox_2" }},
		{"table of 62 characters ending in _held", func(s map[string]any) { s["table"] = strings.Repeat("o", 57) + "_held" }},
		{"maxBatchBytes 64 KiB", func(s map[string]any) { s["maxBatchBytes"] = int64(65536) }},
		{"SASL PLAIN with TLS", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "PLAIN", "credentialsSecretRef": map[string]any{"name": "kafka-user"}}
		}},
		{"table of 63+63 characters", func(s map[string]any) {
			s["table"] = strings.Repeat("s", 63) + "." + strings.Repeat("t", 63)
		}},
		{"table _", func(s map[string]any) { s["table"] = "_" }},
		{"brokers IPv6, FQDN, ports 1 and 65535", func(s map[string]any) {
			kafka(s)["brokers"] = []any{"[::1]:1", "kafka-0.kafka.svc.cluster.local:65535", "10.0.0.7:9092"}
		}},
		{"replicas 0", func(s map[string]any) { s["replicas"] = int64(0) }},
		{"template security contexts within restricted", func(s map[string]any) {
			s["template"] = map[string]any{
				"pod": map[string]any{"securityContext": map[string]any{"runAsNonRoot": true, "runAsUser": int64(1000680000),
					"seccompProfile": map[string]any{"type": "RuntimeDefault"}}},
				"container": map[string]any{"securityContext": map[string]any{"privileged": false, "allowPrivilegeEscalation": false,
					"capabilities": map[string]any{"drop": []any{"NET_RAW", "ALL"}, "add": []any{"NET_BIND_SERVICE"}}, "runAsUser": int64(1000680000), "procMount": "Default",
					"seccompProfile":  map[string]any{"type": "Localhost", "localhostProfile": "relay.json"},
					"appArmorProfile": map[string]any{"type": "RuntimeDefault"}, "seLinuxOptions": map[string]any{"type": "container_t", "level": "s0:c1,c2"},
					"windowsOptions": map[string]any{"hostProcess": false}}},
			}
		}},
		{"autoscaling from 0 to 1 on pending rows", func(s map[string]any) {
			s["autoscaling"] = map[string]any{"minReplicas": int64(0), "maxReplicas": int64(1), "pendingPerReplica": int64(1)}
		}},
		{"autoscaling on both targets, stabilization 0s", func(s map[string]any) {
			s["autoscaling"] = map[string]any{"maxReplicas": int64(1), "pendingPerReplica": int64(1), "oldestAge": "1s", "scaleDownStabilization": "0s"}
		}},
		{"backlog interval 5s and 1h", func(s map[string]any) { s["backlog"] = map[string]any{"interval": "5s"}; s["lagThreshold"] = "24h" }},
		{"lagThreshold 1s", func(s map[string]any) { s["lagThreshold"] = "1s"; s["backlog"] = map[string]any{"interval": "1h"} }},
		{"ordering PartitionKey", func(s map[string]any) { s["ordering"] = "PartitionKey" }},
		{"TLS without a Secret, SASL SCRAM", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "SCRAM-SHA-256", "credentialsSecretRef": map[string]any{"name": "kafka-user"}}
		}},
		{"OAUTHBEARER from a token endpoint on the pod's loopback", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "credentialsSecretRef": map[string]any{"name": "idp-client"},
				"oauth": map[string]any{"tokenEndpoint": "http://127.0.0.1:8080/token", "scope": "kafka"}}
		}},
		{"OAUTHBEARER from a token file, AWS_MSK_IAM", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "oauth": map[string]any{"tokenFile": "/var/run/secrets/kafka/token"}}
		}},
		{"logical replication capture keeping 8Gi of WAL", func(s map[string]any) {
			s["capture"] = map[string]any{"mode": "LogicalReplication", "maxRetainedWAL": "8Gi"}
		}},
		{"logical replication with writer deletes", func(s map[string]any) {
			s["capture"] = map[string]any{"mode": "LogicalReplication", "writerDeletes": true}
		}},
		{"AWS_MSK_IAM with a region", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "AWS_MSK_IAM", "aws": map[string]any{"region": "eu-west-1"}}
		}},
		{"cloudEventsSource as a URN", func(s map[string]any) {
			s["cloudEventsSource"] = "urn:outbox:orders"
		}},
		{"cloudEventsSource as a URL with user, port, query and fragment", func(s map[string]any) {
			s["cloudEventsSource"] = "https://relay@orders.example:8443/outbox/%C3%A9?table=outbox#v1"
		}},
		{"cloudEventsSource as a relative path", func(s map[string]any) { s["cloudEventsSource"] = "outbox/orders" }},
		{"OAUTHBEARER endpoint with a port", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "credentialsSecretRef": map[string]any{"name": "c"},
				"oauth": map[string]any{"tokenEndpoint": "https://idp.example:8443/oauth2/token"}}
		}},
		{"OAUTHBEARER endpoint on the IPv6 loopback", func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "credentialsSecretRef": map[string]any{"name": "c"},
				"oauth": map[string]any{"tokenEndpoint": "http://[::1]:8080/token"}}
		}},
		{"serviceAccountName and priorityClassName with dots", func(s map[string]any) {
			s["template"] = map[string]any{"pod": map[string]any{"serviceAccountName": "orders.relay-1"}}
			s["priorityClassName"] = "system-cluster-critical"
		}},
		{"requests equal to limits, a request without a limit, numbers", func(s map[string]any) {
			s["resources"] = map[string]any{"requests": map[string]any{"memory": "256Mi", "cpu": int64(1)}, "limits": map[string]any{"memory": "0.25Gi"}}
		}},
		{"template env name with dots and dashes", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{"env": []any{map[string]any{"name": "app.config-1", "value": "x"}}}}
		}},
		{"template env names of every printable ASCII character but =", func(s map[string]any) {
			s["template"] = map[string]any{"container": map[string]any{
				"env":     []any{map[string]any{"name": "1st var:~!<>?", "value": "x"}, map[string]any{"name": " ", "value": "y"}},
				"envFrom": []any{map[string]any{"prefix": "cfg.", "configMapRef": map[string]any{"name": "app"}}, map[string]any{"prefix": "", "secretRef": map[string]any{"name": "app"}}},
			}}
		}},
		{"retained WAL of 1Pi", func(s map[string]any) {
			s["capture"] = map[string]any{"mode": "LogicalReplication", "maxRetainedWAL": "1Pi"}
		}},
		{"dsnSecretRef with a dotted name and custom key", func(s map[string]any) {
			s["dsnSecretRef"] = map[string]any{"name": "orders.db-credentials", "key": "DATABASE_URL"}
		}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.NoError(t, c.Create(context.Background(), manifest(ns, fmt.Sprintf("valid-%d", i), tc.edit)))
		})
	}
	t.Run("name of 57 characters", func(t *testing.T) {
		t.Parallel()
		require.NoError(t, c.Create(context.Background(), manifest(ns, "n"+strings.Repeat("0", 56), nil)))
	})
}

// TestAPIServerDefaults checks the defaults the CRD fills in for a minimal manifest.
func TestAPIServerDefaults(t *testing.T) {
	c := adminClient(t)
	ns := newNamespace(t, c)
	u := manifest(ns, "minimal", func(s map[string]any) {
		delete(s, "table")
		delete(s, "batchSize")
		delete(s, "pollInterval")
	})
	require.NoError(t, c.Create(context.Background(), u))
	got := &outboxv1alpha1.OutboxRelay{}
	require.NoError(t, c.Get(context.Background(), key(u), got))
	require.Equal(t, "outbox", got.Spec.Table)
	require.Equal(t, ptr.To[int32](50), got.Spec.BatchSize)
	require.Equal(t, ptr.To[int32](4<<20), got.Spec.MaxBatchBytes)
	require.Equal(t, "200ms", got.Spec.PollInterval)
	require.Equal(t, relayconfig.DefaultLinger.String(), got.Spec.Linger)
	require.Equal(t, "dsn", got.Spec.DSNSecretRef.Key)
	require.Equal(t, int32(1), *got.Spec.Replicas)
	require.Equal(t, outboxv1alpha1.OrderingNone, got.Spec.Ordering)
	require.False(t, got.Spec.Suspend)
	require.Equal(t, "1m", got.Spec.LagThreshold)
	require.Nil(t, got.Spec.Autoscaling)
	require.Nil(t, got.Spec.Backlog, "the operator reads every 15s when spec.backlog is absent")

	auto := manifest(ns, "autoscaled", func(s map[string]any) {
		s["autoscaling"] = map[string]any{"maxReplicas": int64(4), "pendingPerReplica": int64(100)}
		s["backlog"] = map[string]any{}
	})
	require.NoError(t, c.Create(context.Background(), auto))
	require.NoError(t, c.Get(context.Background(), key(auto), got))
	require.Equal(t, ptr.To[int32](1), got.Spec.Autoscaling.MinReplicas)
	require.Equal(t, "5m", got.Spec.Autoscaling.ScaleDownStabilization)
	require.Equal(t, "15s", got.Spec.Backlog.Interval)
}

// TestAPIServerRefusesLeavingWriterDeletesInOneStep: events that writers
// deleted are only in the slot until a relay with logical replication
// publishes them, so a relay with writer deletes may not switch to Poll,
// drop its capture or change its table in one apply; it may switch writer
// deletes off, and then do so.
func TestAPIServerRefusesLeavingWriterDeletesInOneStep(t *testing.T) {
	c := adminClient(t)
	ns := newNamespace(t, c)
	ctx := context.Background()
	u := manifest(ns, "writer-deletes", func(s map[string]any) {
		s["capture"] = map[string]any{"mode": "LogicalReplication", "writerDeletes": true}
	})
	require.NoError(t, c.Create(ctx, u))
	for name, edit := range map[string]func(spec map[string]any){
		"to Poll":         func(s map[string]any) { s["capture"] = map[string]any{"mode": "Poll"} },
		"without capture": func(s map[string]any) { delete(s, "capture") },
		"another table":   func(s map[string]any) { s["table"] = "outbox_v2" },
	} {
		changed := u.DeepCopy()
		edit(changed.Object["spec"].(map[string]any))
		err := c.Update(ctx, changed)
		require.True(t, apierrors.IsInvalid(err), "%s: want 422 Invalid, got %v", name, err)
		require.ErrorContains(t, err, "spec.capture")
		require.ErrorContains(t, err, "set writerDeletes: false first", name)
	}
	// Other changes go through.
	kafka(u.Object["spec"].(map[string]any))["brokers"] = []any{"kafka-1.kafka:9092"}
	require.NoError(t, c.Update(ctx, u))
	// Writer deletes off first, then Poll: each step is taken.
	u.Object["spec"].(map[string]any)["capture"] = map[string]any{"mode": "LogicalReplication", "writerDeletes": false}
	require.NoError(t, c.Update(ctx, u))
	u.Object["spec"].(map[string]any)["capture"] = map[string]any{"mode": "Poll"}
	require.NoError(t, c.Update(ctx, u))
}

// TestAPIServerAndRelayAgreeOnURLs applies seeded random URI-like strings
// as spec.cloudEventsSource and spec.kafka.sasl.oauth.tokenEndpoint (dry
// run) and compares the API server's verdict with the relay's own check.
// The API server must never admit a value the relay refuses: such a relay
// would be accepted at apply time and fail only at reconcile. For the
// source the verdicts must be equal, since the relay applies the CRD's
// rules itself.
func TestAPIServerAndRelayAgreeOnURLs(t *testing.T) {
	c := adminClient(t)
	ns := newNamespace(t, c)
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rnd := rand.New(rand.NewPCG(uint64(seed), 0))
	pieces := []string{"https://", "http://", "//", "urn:", "localhost", "127.0.0.1", "[::1]", "[", "]", ":", ":8080", "/", "?", "#",
		"@", "%", "%2F", "%zz", "a", "B", "1", ".", "-", "_", "~", "!", "'", "(", "*", "+", ",", ";", "=", " ", "é", "orders.example"}
	random := func() string {
		var b strings.Builder
		for n := 1 + rnd.IntN(6); n > 0; n-- {
			b.WriteString(pieces[rnd.IntN(len(pieces))])
		}
		return b.String()
	}
	apiAdmits := func(t *testing.T, i int, edit func(spec map[string]any)) bool {
		err := c.Create(context.Background(), manifest(ns, fmt.Sprintf("url-%d", i), edit), client.DryRunAll)
		if err != nil && !apierrors.IsInvalid(err) {
			require.NoError(t, err)
		}
		return err == nil
	}
	// Values that once told them apart come first, then random ones.
	fixed := []string{"https://[1]:8080#orders.example", "https://[1.2.3.4]/token", "https://[fffff::]/", "https://[:8080]",
		"http://127.0.0.1://%zz%%2F", "https://https://%zzhttp://[::1].localhost"}
	var admitted, refused, sources int
	for i := range 150 + len(fixed) {
		src, endpoint := random(), []string{"https://", "http://", ""}[rnd.IntN(3)]+random()
		if i < len(fixed) {
			src, endpoint = fixed[i], fixed[i]
		}
		api := apiAdmits(t, i, func(s map[string]any) { s["cloudEventsSource"] = src })
		if api {
			sources++
		}
		relayErr := relayconfig.CheckCloudEventsSource(src)
		require.Equal(t, relayErr == nil, api, "spec.cloudEventsSource %q: the API server admits it: %v; the relay: %v", src, api, relayErr)
		if api := apiAdmits(t, i, func(s map[string]any) {
			kafka(s)["tls"] = map[string]any{}
			kafka(s)["sasl"] = map[string]any{"mechanism": "OAUTHBEARER", "credentialsSecretRef": map[string]any{"name": "c"},
				"oauth": map[string]any{"tokenEndpoint": endpoint}}
		}); api {
			admitted++
			require.NoError(t, relayconfig.CheckTokenEndpoint(endpoint), "spec.kafka.sasl.oauth.tokenEndpoint %q: the API server admits it, the relay does not", endpoint)
		} else {
			refused++
		}
	}
	t.Logf("sources admitted %d of %d; token endpoints admitted %d, refused %d", sources, 150+len(fixed), admitted, refused)
}

// TestEnvNamesAgreeWithThePodRule: for environment variable names and
// envFrom prefixes on both sides of the rule, the CRD, the operator's own
// check and the API server's verdict on a relay Deployment holding them all
// agree, so an OutboxRelay the API server takes never becomes a Deployment
// it refuses.
func TestEnvNamesAgreeWithThePodRule(t *testing.T) {
	c := adminClient(t)
	ns := newNamespace(t, c)
	for i, tc := range []struct {
		name   string
		prefix bool // an envFrom prefix, not an env name
		accept bool
	}{
		{"APP_MODE", false, true},
		{"app.config-1", false, true},
		{"1st var:~", false, true},
		{" ", false, true},
		{"A=B", false, false},
		{"=", false, false},
		{"", false, false},
		{"A\tB", false, false},
		{"A\x7fB", false, false},
		{"é", false, false},
		{"CFG_", true, true},
		{"cfg. ~", true, true},
		{"CFG=", true, false},
		{"\tCFG", true, false},
	} {
		t.Run(fmt.Sprintf("%q prefix=%v", tc.name, tc.prefix), func(t *testing.T) {
			t.Parallel()
			container := map[string]any{"env": []any{map[string]any{"name": tc.name, "value": "1"}}}
			if tc.prefix {
				container = map[string]any{"envFrom": []any{map[string]any{"prefix": tc.name, "configMapRef": map[string]any{"name": "app"}}}}
			}
			u := manifest(ns, fmt.Sprintf("envname-%d", i), func(s map[string]any) {
				s["template"] = map[string]any{"container": container}
			})
			relay := &outboxv1alpha1.OutboxRelay{}
			require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, relay))

			crdErr := c.Create(context.Background(), u, client.DryRunAll)
			operatorErr := validateSpec(relay, testImages)

			// The Deployment the operator builds, with the name put back
			// where its check would have stopped it.
			valid := relay.DeepCopy()
			valid.Spec.Template.Container = &outboxv1alpha1.RelayContainerSpec{}
			d, err := buildDeployment(valid, testImages, secretInputs{}, nil)
			require.NoError(t, err)
			ct := &d.Spec.Template.Spec.Containers[0]
			if tc.prefix {
				ct.EnvFrom = append(ct.EnvFrom, corev1.EnvFromSource{Prefix: tc.name, ConfigMapRef: &corev1.ConfigMapEnvSource{LocalObjectReference: corev1.LocalObjectReference{Name: "app"}}})
			} else {
				ct.Env = append(ct.Env, corev1.EnvVar{Name: tc.name, Value: "1"})
			}
			d.Namespace = ns
			podErr := c.Create(context.Background(), d, client.DryRunAll)

			require.Equal(t, tc.accept, podErr == nil, "API server on the Deployment: %v", podErr)
			require.Equal(t, tc.accept, crdErr == nil, "API server on the OutboxRelay: %v", crdErr)
			require.Equal(t, tc.accept, operatorErr == nil, "operator: %v", operatorErr)
			if !tc.accept {
				field := "spec.template.container.env[0].name"
				if tc.prefix {
					field = "spec.template.container.envFrom[0].prefix"
				}
				for _, err := range []error{crdErr, operatorErr} {
					require.ErrorContains(t, err, field)
					require.ErrorContains(t, err, strconv.Quote(tc.name))
				}
			}
		})
	}
}

// An API server's refusal of the Deployment names the OutboxRelay's fields,
// indexed as the spec lists them: the relay's own variables, volumes and
// mounts come first in the Deployment. Before, env[5] named the spec's
// first variable.
func TestInRelayTerms(t *testing.T) {
	d := &appsv1.Deployment{}
	d.Spec.Template.Spec.Containers = []corev1.Container{{
		Env:          make([]corev1.EnvVar, 5+2),
		VolumeMounts: make([]corev1.VolumeMount, 1+1),
	}}
	d.Spec.Template.Spec.Volumes = make([]corev1.Volume, 1+1)
	tmpl := &outboxv1alpha1.RelayPodTemplate{
		Pod: &outboxv1alpha1.RelayPodSpec{Volumes: make([]outboxv1alpha1.RelayVolume, 1), SecurityContext: &corev1.PodSecurityContext{}},
		Container: &outboxv1alpha1.RelayContainerSpec{Env: make([]outboxv1alpha1.RelayEnvVar, 2), VolumeMounts: make([]corev1.VolumeMount, 1),
			SecurityContext: &corev1.SecurityContext{}},
	}
	for in, want := range map[string]string{
		`spec.template.spec.containers[0].env[6].name: Invalid value: "a b"`:              `spec.template.container.env[1].name: Invalid value: "a b"`,
		`spec.template.spec.containers[0].env[2].value: Required`:                         `spec.template.spec.containers[0].env[2].value: Required`,
		`spec.template.spec.containers[0].envFrom[0].prefix: Invalid`:                     `spec.template.container.envFrom[0].prefix: Invalid`,
		`spec.template.spec.containers[0].volumeMounts[1].subPath: Invalid value: "/abs"`: `spec.template.container.volumeMounts[0].subPath: Invalid value: "/abs"`,
		`spec.template.spec.volumes[1].name: Duplicate value`:                             `spec.template.pod.volumes[0].name: Duplicate value`,
		`spec.template.spec.nodeSelector: Invalid value: "a/b/c"`:                         `spec.nodeSelector: Invalid value: "a/b/c"`,
		`spec.template.spec.tolerations[0].key: Invalid`:                                  `spec.tolerations[0].key: Invalid`,
		`spec.replicas: Invalid`:                                                          `spec.replicas: Invalid`,
		`spec.template.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].values: Required value`: `spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].values: Required value`,
		`spec.template.spec.containers[0].resources.limits[foo]: Invalid`:                                                                                         `spec.resources.limits[foo]: Invalid`,
		`spec.template.spec.containers[0].securityContext.runAsUser: Invalid`:                                                                                     `spec.template.container.securityContext.runAsUser: Invalid`,
		`spec.template.spec.securityContext.runAsUser: Invalid`:                                                                                                   `spec.template.pod.securityContext.runAsUser: Invalid`,
		`spec.template.spec.initContainers[0].name: Invalid`:                                                                                                      `spec.template.spec.initContainers[0].name: Invalid`,
	} {
		require.Equal(t, want, inRelayTerms(in, d, tmpl), in)
	}
	// Without a security context in the spec, a refusal of one is of the
	// operator's defaults: the Deployment's path stays.
	tmpl.Pod.SecurityContext, tmpl.Container.SecurityContext = nil, nil
	for _, in := range []string{
		`spec.template.spec.securityContext.seccompProfile.type: Forbidden: seccomp type in annotation and field must match`,
		`spec.template.spec.containers[0].securityContext.seccompProfile.type: Forbidden`,
	} {
		require.Equal(t, in, inRelayTerms(in, d, tmpl))
	}
}
