package controllers

import (
	"cmp"
	"errors"
	"fmt"
	"path"
	"regexp"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// tlsMountPath is where the Kafka TLS Secret is mounted in a relay pod.
const tlsMountPath = outboxv1alpha1.ReservedMountDir + "/tls"

// relayBinary is the relay's program in its image.
const relayBinary = "/relay"

// ownPath reports whether a template's mount at p (a clean path) would
// cover what the relay owns: its binary (a mount over it would run another
// program with the relay's Secrets, past the image allow-list), its
// mounts under /etc/relay, or the root. The API's rule refuses the plain
// spellings; this refuses the others ("//relay", "/etc/relay/./tls").
func ownPath(p string) bool {
	const etc = outboxv1alpha1.ReservedMountDir
	return p == "/" || p == relayBinary || p == etc || strings.HasPrefix(p, etc+"/")
}

// mountPath is where the kubelet mounts a volume mount's path p: under /
// when p is relative (the API takes "relay", which is then /relay), and
// clean.
func mountPath(p string) string {
	return path.Clean("/" + p)
}

// kafkaTLSKeys are the keys of the Kafka TLS Secret a relay reads: its CA
// and its client certificate, each optional.
var kafkaTLSKeys = []string{outboxv1alpha1.DefaultCAKey, corev1.TLSCertKey, corev1.TLSPrivateKeyKey}

// dbTLSMountPath is where spec.database.tls's CA (ca.crt) and client
// certificate (tls.crt, tls.key) are mounted in a relay pod.
const dbTLSMountPath = outboxv1alpha1.ReservedMountDir + "/" + outboxv1alpha1.ReservedDatabaseVolume

// orderings maps the API's ordering modes to the relay's.
var orderings = map[outboxv1alpha1.OrderingMode]relayconfig.Ordering{
	outboxv1alpha1.OrderingNone:         relayconfig.OrderingNone,
	outboxv1alpha1.OrderingPartitionKey: relayconfig.OrderingPartitionKey,
}

// onPublishes maps the API's retention modes to the relay's.
var onPublishes = map[outboxv1alpha1.OnPublishMode]relayconfig.OnPublish{
	outboxv1alpha1.OnPublishMark:   relayconfig.OnPublishMark,
	outboxv1alpha1.OnPublishDelete: relayconfig.OnPublishDelete,
}

// formats maps the API's record formats to the relay's.
var formats = map[outboxv1alpha1.RecordFormat]relayconfig.Format{
	outboxv1alpha1.FormatRaw:                   relayconfig.FormatRaw,
	outboxv1alpha1.FormatCloudEvents:           relayconfig.FormatCloudEvents,
	outboxv1alpha1.FormatCloudEventsStructured: relayconfig.FormatCloudEventsStructured,
}

// recordTimestamps maps the API's record timestamps to the relay's.
var recordTimestamps = map[outboxv1alpha1.RecordTimestamp]relayconfig.RecordTimestamp{
	outboxv1alpha1.RecordTimestampCreatedAt: relayconfig.RecordTimestampCreatedAt,
	outboxv1alpha1.RecordTimestampPublish:   relayconfig.RecordTimestampPublish,
}

// captures maps the API's capture modes to the relay's.
var captures = map[outboxv1alpha1.CaptureMode]relayconfig.Capture{
	outboxv1alpha1.CapturePoll:               relayconfig.CapturePoll,
	outboxv1alpha1.CaptureLogicalReplication: relayconfig.CaptureLogicalReplication,
}

// databaseAuths maps the API's database login methods to the relay's.
var databaseAuths = map[outboxv1alpha1.DatabaseAuthMethod]relayconfig.DatabaseAuth{
	outboxv1alpha1.DatabaseAuthPassword:       relayconfig.DatabaseAuthPassword,
	outboxv1alpha1.DatabaseAuthAWSRDSIAM:      relayconfig.DatabaseAuthAWSRDSIAM,
	outboxv1alpha1.DatabaseAuthGCPCloudSQLIAM: relayconfig.DatabaseAuthGCPCloudSQLIAM,
	outboxv1alpha1.DatabaseAuthAzureAD:        relayconfig.DatabaseAuthAzureAD,
}

// databaseAuthOf is spec.database.auth as the relay's settings: the
// method and the AWS region.
func databaseAuthOf(db *outboxv1alpha1.DatabaseSpec) (dbAuth, error) {
	if db == nil || db.Auth == nil {
		return dbAuth{method: relayconfig.DatabaseAuthPassword}, nil
	}
	m, ok := databaseAuths[cmp.Or(db.Auth.Method, outboxv1alpha1.DatabaseAuthPassword)]
	if !ok {
		return dbAuth{}, fmt.Errorf("spec.database.auth.method: %q is not one of %s", db.Auth.Method, enumValues(databaseAuths))
	}
	a := dbAuth{method: m}
	if db.Auth.AWS != nil {
		a.region = db.Auth.AWS.Region
	}
	return a, nil
}

// tracingEnv is the OTEL_* environment of a relay pod whose spec asks for
// tracing; empty without spec.tracing (the relay then records no spans).
func tracingEnv(relay *outboxv1alpha1.OutboxRelay) []corev1.EnvVar {
	t := relay.Spec.Tracing
	if t == nil {
		return nil
	}
	return []corev1.EnvVar{
		{Name: relayconfig.EnvOTELTracesExporter, Value: "otlp"},
		{Name: relayconfig.EnvOTELExporterOTLPEndpoint, Value: t.OTLPEndpoint},
		{Name: relayconfig.EnvOTELServiceName, Value: relay.Name + "-relay"},
	}
}

// relaySettings are the relay settings an OutboxRelay means: every API value
// becomes its relay value here and nowhere else. A field the spec leaves
// empty takes the relay's default, which the CRD's default equals. Secret
// values are not among them (the pod gets them from the Secrets); in says
// which TLS files the TLS Secret provides. The only error is a value that
// cannot be put on a command line at all; rules are checked by checkSettings.
func relaySettings(relay *outboxv1alpha1.OutboxRelay, in secretInputs) (relayconfig.Command, error) {
	s, err := specSettings(relay)
	kafkaFiles(&s, in)
	return s, err
}

// specSettings are relaySettings without the files of the TLS Secret.
func specSettings(relay *outboxv1alpha1.OutboxRelay) (relayconfig.Command, error) {
	spec := &relay.Spec
	s := relayconfig.Defaults()
	s.Table = cmp.Or(spec.Table, s.Table)
	for _, b := range spec.Kafka.Brokers {
		s.Brokers = append(s.Brokers, string(b))
	}
	if len(spec.Topics) > 0 {
		s.Topics = make(map[string]string, len(spec.Topics))
		for eventType, topic := range spec.Topics {
			s.Topics[eventType] = string(topic)
		}
	}
	s.DeadLetterTopic = string(spec.DeadLetterTopic)
	if spec.BatchSize != nil {
		s.BatchSize = int(*spec.BatchSize)
	}
	if spec.MaxBatchBytes != nil {
		s.MaxBatchBytes = int(*spec.MaxBatchBytes)
	}
	if spec.MaxInFlight != nil {
		s.MaxInFlight = int(*spec.MaxInFlight)
	}
	s.Notify = spec.Notify
	if r := spec.Retention; r != nil {
		onPublish, ok := onPublishes[cmp.Or(r.OnPublish, outboxv1alpha1.OnPublishMark)]
		if !ok {
			return s, fmt.Errorf("spec.retention.onPublish: %q is not %s or %s", r.OnPublish, outboxv1alpha1.OnPublishMark, outboxv1alpha1.OnPublishDelete)
		}
		s.OnPublish = onPublish
		if r.KeepPublishedFor != "" {
			d, err := time.ParseDuration(r.KeepPublishedFor)
			if err != nil {
				return s, fmt.Errorf("spec.retention.keepPublishedFor: %q is not a duration", r.KeepPublishedFor)
			}
			s.KeepPublishedFor = d
		}
		if r.PruneBatchSize != nil {
			s.PruneBatchSize = int(*r.PruneBatchSize)
		}
	}
	if spec.PollInterval != "" {
		d, err := time.ParseDuration(spec.PollInterval)
		if err != nil {
			return s, fmt.Errorf("spec.pollInterval: %q is not a duration", spec.PollInterval)
		}
		s.PollInterval = d
	}
	if spec.Linger != "" {
		d, err := time.ParseDuration(spec.Linger)
		if err != nil {
			return s, fmt.Errorf("spec.linger: %q is not a duration", spec.Linger)
		}
		s.Linger = d
	}
	if spec.StallTimeout != "" {
		d, err := time.ParseDuration(spec.StallTimeout)
		if err != nil {
			return s, fmt.Errorf("spec.stallTimeout: %q is not a duration", spec.StallTimeout)
		}
		s.StallTimeout = d
	}
	ordering, ok := orderings[cmp.Or(spec.Ordering, outboxv1alpha1.OrderingNone)]
	if !ok {
		return s, fmt.Errorf("spec.ordering: %q is not %s or %s", spec.Ordering, outboxv1alpha1.OrderingNone, outboxv1alpha1.OrderingPartitionKey)
	}
	s.Ordering = ordering
	format, ok := formats[cmp.Or(spec.Format, outboxv1alpha1.FormatRaw)]
	if !ok {
		return s, fmt.Errorf("spec.format: %q is not %s, %s or %s", spec.Format, outboxv1alpha1.FormatRaw, outboxv1alpha1.FormatCloudEvents, outboxv1alpha1.FormatCloudEventsStructured)
	}
	s.Format = format
	ts, ok := recordTimestamps[cmp.Or(spec.RecordTimestamp, outboxv1alpha1.RecordTimestampCreatedAt)]
	if !ok {
		return s, fmt.Errorf("spec.recordTimestamp: %q is not %s or %s", spec.RecordTimestamp, outboxv1alpha1.RecordTimestampCreatedAt, outboxv1alpha1.RecordTimestampPublish)
	}
	s.RecordTimestamp = ts
	s.CloudEventsSource = spec.CloudEventsSource
	s.PartitionColumn = spec.PartitionColumn
	if c := spec.Capture; c != nil {
		mode, ok := captures[cmp.Or(c.Mode, outboxv1alpha1.CapturePoll)]
		if !ok {
			return s, fmt.Errorf("spec.capture.mode: %q is not one of %s", c.Mode, enumValues(captures))
		}
		s.Capture = mode
		if c.MaxRetainedWAL != nil {
			s.MaxRetainedWAL = c.MaxRetainedWAL.Value()
		}
		s.WriterDeletes = c.WriterDeletes
	}
	s.Compression = relayconfig.Compression(cmp.Or(string(spec.Kafka.Compression), string(s.Compression)))
	s.KafkaTLS = spec.Kafka.TLS != nil
	if db := spec.Database; db != nil && db.TLS != nil {
		s.DatabaseCAFile = dbTLSMountPath + "/" + outboxv1alpha1.DefaultCAKey
		if db.TLS.ClientCertSecretRef != nil {
			s.DatabaseCertFile, s.DatabaseKeyFile = dbTLSMountPath+"/"+corev1.TLSCertKey, dbTLSMountPath+"/"+corev1.TLSPrivateKeyKey
		}
	}
	if sasl := spec.Kafka.SASL; sasl != nil {
		s.KafkaSASLMechanism = string(sasl.Mechanism)
		if o := sasl.OAuth; o != nil {
			s.KafkaSASLOAuthTokenFile, s.KafkaSASLOAuthTokenEndpoint, s.KafkaSASLOAuthScope = o.TokenFile, o.TokenEndpoint, o.Scope
		}
		if a := sasl.AWS; a != nil {
			s.KafkaSASLAWSRegion = a.Region
		}
	}
	auth, err := databaseAuthOf(spec.Database)
	if err != nil {
		return s, err
	}
	s.DatabaseAuth, s.DatabaseAuthAWSRegion = auth.method, auth.region
	return s, nil
}

// kafkaFiles points s at the files the TLS Secret provides (in says which).
func kafkaFiles(s *relayconfig.Command, in secretInputs) {
	if !s.KafkaTLS {
		return
	}
	if in.TLSCA {
		s.KafkaTLSCAFile = tlsMountPath + "/" + outboxv1alpha1.DefaultCAKey
	}
	if in.TLSClientCert {
		s.KafkaTLSCertFile, s.KafkaTLSKeyFile = tlsMountPath+"/"+corev1.TLSCertKey, tlsMountPath+"/"+corev1.TLSPrivateKeyKey
	}
}

// specFields names the spec field behind each relay flag the operator sets.
var specFields = map[string]string{
	relayconfig.FlagTable:                       "spec.table",
	relayconfig.FlagBrokers:                     "spec.kafka.brokers",
	relayconfig.FlagTopic:                       "spec.topics",
	relayconfig.FlagDeadLetterTopic:             "spec.deadLetterTopic",
	relayconfig.FlagBatchSize:                   "spec.batchSize",
	relayconfig.FlagMaxBatchBytes:               "spec.maxBatchBytes",
	relayconfig.FlagPollInterval:                "spec.pollInterval",
	relayconfig.FlagLinger:                      "spec.linger",
	relayconfig.FlagStallTimeout:                "spec.stallTimeout",
	relayconfig.FlagOrdering:                    "spec.ordering",
	relayconfig.FlagKafkaSASLMech:               "spec.kafka.sasl.mechanism",
	relayconfig.FlagKafkaSASLOAuthTokenFile:     "spec.kafka.sasl.oauth.tokenFile",
	relayconfig.FlagKafkaSASLOAuthTokenEndpoint: "spec.kafka.sasl.oauth.tokenEndpoint",
	relayconfig.FlagKafkaSASLOAuthScope:         "spec.kafka.sasl.oauth.scope",
	relayconfig.FlagKafkaSASLAWSRegion:          "spec.kafka.sasl.aws.region",
	relayconfig.FlagDatabaseAuth:                "spec.database.auth.method",
	relayconfig.FlagDatabaseAuthAWSRegion:       "spec.database.auth.aws.region",
	relayconfig.FlagFormat:                      "spec.format",
	relayconfig.FlagRecordTimestamp:             "spec.recordTimestamp",
	relayconfig.FlagCloudEventsSource:           "spec.cloudEventsSource",
	relayconfig.FlagPartitionColumn:             "spec.partitionColumn",
	relayconfig.FlagCapture:                     "spec.capture.mode",
	relayconfig.FlagMaxRetainedWAL:              "spec.capture.maxRetainedWAL",
	relayconfig.FlagWriterDeletes:               "spec.capture.writerDeletes",
	relayconfig.FlagCompression:                 "spec.kafka.compression",
	relayconfig.FlagMaxInFlight:                 "spec.maxInFlight",
	relayconfig.FlagNotify:                      "spec.notify",
	relayconfig.FlagOnPublish:                   "spec.retention.onPublish",
	relayconfig.FlagKeepPublishedFor:            "spec.retention.keepPublishedFor",
	relayconfig.FlagPruneBatchSize:              "spec.retention.pruneBatchSize",
}

// checkSettings is the relay's own verdict on s (Command.Validate), so a
// spec the relay would refuse is reported instead of becoming pods that
// crash-loop. The DSN and SASL credentials are placeholders: the real ones
// reach the pod from Secrets at run time. Each error names the spec field
// behind the flag it carries.
func checkSettings(s relayconfig.Command) error {
	s.DSN = "from-secret"
	if s.KafkaSASLMechanism != "" {
		s.KafkaSASLUsername, s.KafkaSASLPassword = "from-secret", "from-secret"
	}
	errs := relayconfig.Errors(s.Validate())
	if len(errs) == 0 {
		return nil
	}
	msgs := make([]string, 0, len(errs))
	for _, e := range errs {
		var fe *relayconfig.FieldError
		if errors.As(e, &fe) {
			if field, ok := specFields[fe.Flag]; ok {
				msgs = append(msgs, field+": "+fe.Err.Error())
				continue
			}
		}
		msgs = append(msgs, e.Error())
	}
	return errors.New(strings.Join(msgs, "; "))
}

// images is the operator's relay-image configuration.
type images struct {
	// fallback is the image of relays whose spec names none.
	fallback string
	// allowed are the prefixes spec.image must start with (the operator's
	// --allowed-relay-images). None admits the fallback's repository only,
	// any tag or digest of it; AnyImage admits every image.
	allowed []string
}

// AnyImage in --allowed-relay-images admits every image: it trusts whoever
// may create an OutboxRelay with every Secret they can name.
const AnyImage = "*"

// admits reports whether spec.image may be image, and what it may start with.
func (img images) admits(image string) (bool, []string) {
	if image == img.fallback || slices.Contains(img.allowed, AnyImage) {
		return true, nil
	}
	allowed := img.allowed
	if len(allowed) == 0 {
		repo := imageRepository(img.fallback)
		if image == repo {
			return true, nil
		}
		allowed = []string{repo + ":", repo + "@"}
	}
	return slices.ContainsFunc(allowed, func(p string) bool { return admitsPrefix(p, image) }), allowed
}

// admitsPrefix reports whether image starts with the allowed prefix p. A
// prefix that ends a path part (with /, : or @) matches as it is; one that
// does not is a repository, or a registry or path without the slash, and
// matches only whole parts: registry.example/acme admits
// registry.example/acme:1, registry.example/acme@sha256:… and
// registry.example/acme/relay:1, never registry.example/acme-evil/relay:1.
func admitsPrefix(p, image string) bool {
	if strings.HasSuffix(p, "/") || strings.HasSuffix(p, ":") || strings.HasSuffix(p, "@") {
		return strings.HasPrefix(image, p)
	}
	rest, ok := strings.CutPrefix(image, p)
	return ok && (rest == "" || strings.ContainsRune("/:@", rune(rest[0])))
}

// imageRepository is an image reference without its tag or digest.
func imageRepository(ref string) string {
	if i := strings.Index(ref, "@"); i >= 0 {
		ref = ref[:i]
	}
	if i := strings.LastIndex(ref, ":"); i > strings.LastIndex(ref, "/") {
		ref = ref[:i]
	}
	return ref
}

// checkSpec builds the relay's settings from the spec (without the TLS
// Secret's files: kafkaFiles adds them) and checks what the CRD schema
// cannot express, or expresses only as a copy of the relay's rules: the
// relay's own verdict on the settings, the operator's image allow-list,
// and the labels and annotations the operator reserves. It names every
// spec field at fault. One reconcile builds and checks the settings here,
// once, and hands them to the pure builders.
func checkSpec(relay *outboxv1alpha1.OutboxRelay, img images) (relayconfig.Command, error) {
	spec := &relay.Spec
	var errs []string
	labels, annotations := map[string]map[string]string{"spec.podLabels": spec.PodLabels}, map[string]map[string]string{"spec.podAnnotations": spec.PodAnnotations}
	if t := spec.Template; t != nil && t.Metadata != nil {
		labels["spec.template.metadata.labels"], annotations["spec.template.metadata.annotations"] = t.Metadata.Labels, t.Metadata.Annotations
	}
	for field, l := range labels {
		for k := range l {
			if _, reserved := commonLabels(relay)[k]; reserved {
				errs = append(errs, fmt.Sprintf("%s must not set %s: the operator selects the pods by it", field, k))
			}
		}
	}
	for field, a := range annotations {
		if _, reserved := a[configHashAnnotation]; reserved {
			errs = append(errs, fmt.Sprintf("%s must not set %s: the operator owns it", field, configHashAnnotation))
		}
	}
	for _, m := range containerTemplate(spec.Template).VolumeMounts {
		if p := mountPath(m.MountPath); ownPath(p) {
			errs = append(errs, fmt.Sprintf("spec.template.container.volumeMounts: %q is %s, the relay's own", m.MountPath, p))
		}
	}
	errs = append(errs, checkEnvNames(containerTemplate(spec.Template))...)
	switch {
	case spec.Image == "" && img.fallback == "":
		errs = append(errs, "spec.image is empty and the operator has no default relay image")
	case spec.Image != "":
		if ok, allowed := img.admits(spec.Image); !ok {
			errs = append(errs, fmt.Sprintf("spec.image %q does not start with an allowed prefix (%s; the operator's --allowed-relay-images sets them, %q admits any image)",
				spec.Image, strings.Join(allowed, ", "), AnyImage))
		}
	}
	s, err := specSettings(relay)
	if err == nil {
		err = checkSettings(s)
	}
	if err != nil {
		errs = append(errs, err.Error())
	}
	if len(errs) == 0 {
		pod := relayDeployment(relay, img, s, secretInputs{}, nil).Spec.Template
		errs = podSecurityErrors(&pod.ObjectMeta, &pod.Spec)
	}
	slices.Sort(errs)
	if len(errs) == 0 {
		return s, nil
	}
	return s, errors.New(strings.Join(errs, "; "))
}

// envName and envPrefix are the patterns of the CRD's env names and
// envFrom prefixes.
var (
	envName   = regexp.MustCompile(outboxv1alpha1.EnvNamePattern)
	envPrefix = regexp.MustCompile(outboxv1alpha1.EnvPrefixPattern)
)

// checkEnvNames refuses the template's environment variable names and
// envFrom prefixes that the API server would refuse in the relay's
// Deployment. The CRD refuses them too; an OutboxRelay stored before it did
// is reported here, naming its own field rather than the Deployment's.
func checkEnvNames(c *outboxv1alpha1.RelayContainerSpec) []string {
	var errs []string
	for i, e := range c.Env {
		if !envName.MatchString(e.Name) {
			errs = append(errs, fmt.Sprintf("spec.template.container.env[%d].name: %q is not an environment variable name: printable ASCII characters other than '='", i, e.Name))
		}
	}
	for i, e := range c.EnvFrom {
		if !envPrefix.MatchString(e.Prefix) {
			errs = append(errs, fmt.Sprintf("spec.template.container.envFrom[%d].prefix: %q is not an environment variable name prefix: printable ASCII characters other than '='", i, e.Prefix))
		}
	}
	return errs
}

// enumValues lists an API enum's values (the keys of its mapping), sorted.
func enumValues[K ~string, V any](m map[K]V) string {
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, string(k))
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}
