// Command manager runs the OutboxRelay controller: it turns OutboxRelays into
// Deployments of relay pods.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/controllers"
	"github.com/outbox-relay/outbox-operator/version"
)

// defaultRelayImage is the image holding /relay: the manager's own image,
// tagged with the release the manager was built from.
func defaultRelayImage() string { return "ghcr.io/outbox-relay/outbox-operator:" + version.Version }

// config is what the flags and environment say.
type config struct {
	metricsAddr, probeAddr string
	printVersion           bool
	metricsSecure          bool
	// metricsCertDir holds tls.crt and tls.key for /metrics; empty: a
	// self-signed certificate made at start.
	metricsCertDir          string
	leaderElect             bool
	leaderElectionID        string
	leaderElectionNamespace string
	relayImage              string
	// allowedImages are the prefixes an OutboxRelay's spec.image must start
	// with; empty admits the relay image's repository, controllers.AnyImage any.
	allowedImages []string
	// namespaces to watch; empty means every namespace.
	namespaces []string
	// secretRefresh is how long what was read of a Secret is used.
	secretRefresh time.Duration
	// connsPerDatabase caps the backlog reads in flight per database.
	connsPerDatabase int
	// databaseTokenLogins lets backlog reads log in with the operator's
	// own cloud identity.
	databaseTokenLogins bool
	// digestKeySecret keeps the key of the digests recorded on the relays'
	// Deployments; zero: none (the key lives as long as the process).
	digestKeySecret types.NamespacedName
	// podMonitorLabels are added to each relay's PodMonitor.
	podMonitorLabels map[string]string
	zap              zap.Options
}

// parseConfig reads the flags, with RELAY_IMAGE, DIGEST_KEY_SECRET,
// POD_NAMESPACE and WATCH_NAMESPACE from the environment (a flag wins over
// RELAY_IMAGE and DIGEST_KEY_SECRET).
func parseConfig(args []string, getenv func(string) string) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("manager", flag.ContinueOnError)
	fs.StringVar(&cfg.metricsAddr, "metrics-bind-address", ":8443",
		"Address the /metrics endpoint binds to; 0 disables it.")
	fs.BoolVar(&cfg.metricsSecure, "metrics-secure", true,
		"Serve /metrics over HTTPS to clients the API server authenticates (TokenReview) and authorizes\n"+
			"(SubjectAccessReview: get on the /metrics URL, the outbox-operator-metrics-reader ClusterRole);\n"+
			"false serves plain HTTP to anyone who can reach the port.")
	fs.StringVar(&cfg.metricsCertDir, "metrics-cert-dir", "",
		"Directory holding tls.crt and tls.key (a cert-manager Secret mounted there) that /metrics serves with\n"+
			"--metrics-secure; empty: a self-signed certificate made at start, which Prometheus cannot verify.")
	fs.StringVar(&cfg.probeAddr, "health-probe-bind-address", ":8081",
		"Address the /healthz and /readyz endpoints bind to.")
	fs.BoolVar(&cfg.leaderElect, "leader-elect", false,
		"Elect a leader so that only one manager replica reconciles at a time.")
	fs.StringVar(&cfg.leaderElectionID, "leader-election-id", controllers.LeaderElectionID,
		"Name of the leader-election Lease. Two installs in one namespace (each watching its own namespaces)\n"+
			"need a name each; the managers of one install must share it, across upgrades too.")
	fs.StringVar(&cfg.leaderElectionNamespace, "leader-election-namespace", "",
		"Namespace of the leader-election Lease (default: the pod's namespace).")
	fs.StringVar(&cfg.relayImage, "relay-image", cmp.Or(getenv("RELAY_IMAGE"), defaultRelayImage()),
		"Relay image for OutboxRelays that set no spec.image (env RELAY_IMAGE).")
	var allowed string
	fs.StringVar(&allowed, "allowed-relay-images", "",
		"Comma-separated image prefixes an OutboxRelay's spec.image must start with; one that does not end with /,\n"+
			": or @ matches whole parts only (registry.example/relays admits registry.example/relays:1 and\n"+
			"registry.example/relays/x:1, not registry.example/relays-other/x:1). Empty admits the\n"+
			"--relay-image's repository only (any tag or digest); \""+controllers.AnyImage+"\" admits any image, which trusts\n"+
			"everyone who may create an OutboxRelay with every Secret they can name. The --relay-image is always allowed.")
	fs.DurationVar(&cfg.secretRefresh, "secret-refresh-interval", controllers.DefaultSecretRefreshInterval,
		"How long the operator uses what it read of a referenced Secret before reading it again (it may get, never\n"+
			"list or watch, Secrets): the longest a changed Secret takes to roll the relay's pods (plus up to a fifth).")
	fs.IntVar(&cfg.connsPerDatabase, "backlog-connections-per-database", controllers.DefaultConnsPerDatabase,
		"Most connections the backlog reads hold to one database (host, port and name), shared by every\n"+
			"OutboxRelay on it (1..100).")
	fs.BoolVar(&cfg.databaseTokenLogins, "database-token-logins", false,
		"Read the backlog of OutboxRelays with spec.database.auth by logging in with the operator's own cloud identity.\n"+
			"Whoever may create an OutboxRelay names the host it logs in at, and with sslmode=require or a CA of their\n"+
			"own could receive that identity's token: enable only where all of them are trusted with its database access.")
	var digestKey string
	fs.StringVar(&digestKey, "digest-key-secret", getenv("DIGEST_KEY_SECRET"),
		"Secret (NAME in the pod's namespace, env POD_NAMESPACE, or NAMESPACE/NAME) that keeps the key of the digests the\n"+
			"operator records on relay Deployments of the Secret values their pods read, so that a restarted operator rolls\n"+
			"only relays whose values changed; the operator fills it when it is empty, and needs get and update on it.\n"+
			"Empty: a key of the process's own, and a restart rolls, once, each relay one of whose Secrets was written\n"+
			"since its pods last rolled (env DIGEST_KEY_SECRET).")
	var podMonitorLabels string
	fs.StringVar(&podMonitorLabels, "relay-podmonitor-labels", "",
		"Labels (KEY=VALUE, comma-separated) added to the PodMonitor of each OutboxRelay with spec.monitoring.podMonitor:\n"+
			"those the cluster's Prometheus selects PodMonitors by (kube-prometheus-stack: release=<its release>).\n"+
			"Without them such a Prometheus scrapes no relay pod.")
	fs.BoolVar(&cfg.printVersion, "version", false, "Print the version and exit.")
	cfg.zap = zap.Options{Development: false} // JSON logs
	cfg.zap.BindFlags(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if cfg.secretRefresh < time.Second || cfg.secretRefresh > 24*time.Hour {
		return cfg, fmt.Errorf("--secret-refresh-interval: %s is outside 1s..24h", cfg.secretRefresh)
	}
	if cfg.connsPerDatabase < 1 || cfg.connsPerDatabase > 100 {
		return cfg, fmt.Errorf("--backlog-connections-per-database: %d is outside 1..100", cfg.connsPerDatabase)
	}
	if cfg.metricsCertDir != "" && !cfg.metricsSecure {
		return cfg, errors.New("--metrics-cert-dir: serves HTTPS, which --metrics-secure=false turns off")
	}
	if errs := validation.IsDNS1123Subdomain(cfg.leaderElectionID); len(errs) > 0 {
		return cfg, fmt.Errorf("--leader-election-id: %q is not a Lease name: %s", cfg.leaderElectionID, strings.Join(errs, "; "))
	}
	if cfg.relayImage == "" {
		return cfg, errors.New("--relay-image (or RELAY_IMAGE) must not be empty")
	}
	if digestKey != "" {
		ns, name, ok := strings.Cut(digestKey, "/")
		if !ok {
			ns, name = getenv("POD_NAMESPACE"), digestKey
		}
		if ns == "" || name == "" || strings.Contains(name, "/") {
			return cfg, fmt.Errorf("--digest-key-secret: %q is not NAME (with POD_NAMESPACE set) or NAMESPACE/NAME", digestKey)
		}
		cfg.digestKeySecret = types.NamespacedName{Namespace: ns, Name: name}
	}
	labels, err := parseLabels(podMonitorLabels)
	if err != nil {
		return cfg, fmt.Errorf("--relay-podmonitor-labels: %w", err)
	}
	cfg.podMonitorLabels = labels
	cfg.allowedImages = splitList(allowed)
	cfg.namespaces = splitList(getenv("WATCH_NAMESPACE"))
	return cfg, nil
}

// parseLabels reads KEY=VALUE pairs, comma-separated, each a valid label;
// the keys the operator labels its children with are its own.
func parseLabels(s string) (map[string]string, error) {
	labels := map[string]string{}
	for _, kv := range splitList(s) {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, fmt.Errorf("%q is not KEY=VALUE", kv)
		}
		if errs := validation.IsQualifiedName(k); len(errs) > 0 {
			return nil, fmt.Errorf("%q: the key is not a label key: %s", kv, strings.Join(errs, "; "))
		}
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			return nil, fmt.Errorf("%q: the value is not a label value: %s", kv, strings.Join(errs, "; "))
		}
		if controllers.OwnLabel(k) {
			return nil, fmt.Errorf("%q: %s is a label the operator sets on the relay's objects", kv, k)
		}
		labels[k] = v
	}
	return labels, nil
}

// splitList splits a comma-separated list, dropping blanks.
func splitList(s string) []string {
	var out []string
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			out = append(out, v)
		}
	}
	return out
}

// managerOptions turns the config into controller-runtime manager options,
// with the cache and client settings the reconciler needs to hold no Secret data.
func managerOptions(cfg config, scheme *runtime.Scheme) ctrl.Options {
	opts := ctrl.Options{
		Scheme:                  scheme,
		Metrics:                 metricsOptions(cfg),
		HealthProbeBindAddress:  cfg.probeAddr,
		LeaderElection:          cfg.leaderElect,
		LeaderElectionID:        cfg.leaderElectionID,
		LeaderElectionNamespace: cfg.leaderElectionNamespace,
		// The manager exits right after it stops leading, so handing the lease
		// over at once is safe and spares the next leader the lease timeout.
		LeaderElectionReleaseOnCancel: true,
	}
	if len(cfg.namespaces) > 0 {
		opts.Cache.DefaultNamespaces = map[string]cache.Config{}
		for _, ns := range cfg.namespaces {
			opts.Cache.DefaultNamespaces[ns] = cache.Config{}
		}
	}
	return controllers.ManagerOptions(opts)
}

// metricsOptions serve /metrics at cfg.metricsAddr; with cfg.metricsSecure
// over HTTPS (the certificate in cfg.metricsCertDir, or a self-signed one),
// to clients the API server authenticates and authorizes.
func metricsOptions(cfg config) metricsserver.Options {
	o := metricsserver.Options{BindAddress: cfg.metricsAddr}
	if cfg.metricsSecure {
		o.SecureServing = true
		o.FilterProvider = filters.WithAuthenticationAndAuthorization
		if cfg.metricsCertDir != "" {
			o.CertDir, o.CertName, o.KeyName = cfg.metricsCertDir, "tls.crt", "tls.key"
		}
	}
	return o
}

// run starts the manager and blocks until ctx ends or the manager fails.
// tweaks adjust the manager options (tests running two managers in one
// process turn off controller-runtime's unique-name check).
func run(ctx context.Context, cfg config, restCfg *rest.Config, tweaks ...func(*ctrl.Options)) error {
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return err
	}
	if err := outboxv1alpha1.AddToScheme(scheme); err != nil {
		return err
	}
	opts := managerOptions(cfg, scheme)
	for _, tweak := range tweaks {
		tweak(&opts)
	}
	mgr, err := ctrl.NewManager(restCfg, opts)
	if err != nil {
		return fmt.Errorf("create manager: %w", err)
	}
	metrics, err := controllers.NewMetrics(ctrlmetrics.Registry)
	if err != nil {
		return fmt.Errorf("register the operator's metrics: %w", err)
	}
	flow := controllers.NewFlowObserver()
	flow.ConnsPerDatabase = cfg.connsPerDatabase
	r := &controllers.OutboxRelayReconciler{
		Client:           mgr.GetClient(),
		APIReader:        mgr.GetAPIReader(),
		Recorder:         mgr.GetEventRecorder("outbox-operator"),
		RelayImage:       cfg.relayImage,
		PodMonitorLabels: cfg.podMonitorLabels,
		AllowedImages:    cfg.allowedImages,
		Flow:             flow,
		Metrics:          metrics,

		DatabaseTokenLogins: cfg.databaseTokenLogins,

		SecretRefreshInterval: cfg.secretRefresh,
		DigestKeySecret:       cfg.digestKeySecret,
	}
	if err := r.SetupWithManager(ctx, mgr); err != nil {
		return fmt.Errorf("set up the OutboxRelay controller: %w", err)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return err
	}
	// Ready once the caches have synced, so a rollout waits for a working manager.
	if err := mgr.AddReadyzCheck("readyz", func(req *http.Request) error {
		if !mgr.GetCache().WaitForCacheSync(req.Context()) {
			return errors.New("caches not synced")
		}
		return nil
	}); err != nil {
		return err
	}
	ctrl.Log.Info("starting manager", "version", version.Version, "relayImage", cfg.relayImage,
		"allowedRelayImages", cfg.allowedImages, "namespaces", cfg.namespaces, "leaderElect", cfg.leaderElect,
		"digestKeySecret", cfg.digestKeySecret.String())
	return mgr.Start(ctx)
}

func main() {
	cfg, err := parseConfig(os.Args[1:], os.Getenv)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "manager:", err)
		os.Exit(2)
	}
	if cfg.printVersion {
		fmt.Println(version.String("manager"))
		return
	}
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(&cfg.zap)))
	if err := run(ctrl.SetupSignalHandler(), cfg, ctrl.GetConfigOrDie()); err != nil {
		ctrl.Log.Error(err, "manager stopped")
		os.Exit(1)
	}
}
