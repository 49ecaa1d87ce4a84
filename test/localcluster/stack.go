// Package localcluster runs the whole system on one machine for `make demo`
// and the end-to-end test: PostgreSQL, a Kafka broker, and a real one-node
// Kubernetes cluster (kube-apiserver + etcd, kube-controller-manager,
// kube-scheduler, kube-proxy, the kubelet and containerd) with the operator
// installed from config/default, running from the image `make images`
// builds.
//
// It is a development and test tool: it runs as root, creates a bridge
// (BridgeName) for the pods' network, and undoes what it changed on Close,
// or at the next start after a run that was killed (machine.go): only what
// it made itself.
package localcluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync"

	"github.com/go-logr/logr"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// Options say where the stack keeps its state.
type Options struct {
	// Dir holds every file of the stack: data, logs, kubeconfig, the
	// node's state. It is created if missing; leftovers of an earlier run
	// in it are the caller's business (see CleanDir).
	Dir string
	// Log receives progress; nil discards.
	Log *slog.Logger
	// Progress, when set, is called with a short line as each piece starts.
	Progress func(string)
	// ExtraImages are more docker-archive tarballs the node's container
	// runtime loads (another release's operator image, for an upgrade).
	ExtraImages []string
	// NoOperator leaves the operator and its CRD out: the caller installs
	// one (the upgrade test installs the previous release, with its CRD).
	NoOperator bool
}

// Stack is a running local system.
type Stack struct {
	// Postgres is the PostgreSQL cluster: on loopback any role logs in by
	// name (trust); at HostIP, pods log in with a password, never as the
	// superuser.
	Postgres *testenv.PostgresCluster
	// Kafka is the single-node broker, at HostIP.
	Kafka *testenv.KafkaBroker
	// Kube is the API server and etcd, at HostIP.
	Kube *testenv.KubeEnv
	// Client reaches the API server as admin.
	Client client.Client
	// Kubeconfig is the path of an admin kubeconfig for kubectl.
	Kubeconfig string
	// Dir is Options.Dir.
	Dir string
	// OperatorImage is the image the manager and the relay pods run.
	OperatorImage string

	node     *node
	closeMu  sync.Mutex
	closers  []func() error
	isClosed bool
}

// Start brings the stack up. On error, what was started is stopped. A
// machine that cannot run the node (CheckHost) is refused before anything
// starts.
func Start(ctx context.Context, opts Options) (s *Stack, err error) {
	if err := CheckHost(); err != nil {
		return nil, err
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	progress := opts.Progress
	if progress == nil {
		progress = func(string) {}
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return nil, err
	}
	ctrl.SetLogger(logr.FromSlogHandler(opts.Log.Handler()))
	s = &Stack{Dir: dir, Kubeconfig: filepath.Join(dir, "kubeconfig")}
	defer func() {
		if err != nil {
			s.Close()
			s = nil
		}
	}()
	unlock, err := lockMachine(ctx, progress)
	if err != nil {
		return s, err
	}
	s.closers = append(s.closers, unlock)
	if err := theMachine.prepare(filepath.Join(dir, "node")); err != nil {
		return s, err
	}
	s.closers = append(s.closers, theMachine.recover) // last before the unlock: sysctls, and whatever the node left
	if err := ensureBridge(); err != nil {
		return s, err
	}
	s.closers = append(s.closers, removeBridge)
	progress(fmt.Sprintf("pod network   bridge %s, this machine at %s, pods in %s", BridgeName, HostIP, PodCIDR))

	// The dependencies and the images start in parallel: the JVM and the
	// image build are the slow ones.
	var wg sync.WaitGroup
	var pgErr, kafkaErr, kubeErr, imgErr error
	var images imageSet
	wg.Add(4)
	go func() {
		defer wg.Done()
		s.Postgres, pgErr = testenv.StartPostgres(filepath.Join(dir, "postgres"), testenv.Listen{Host: HostIP, Clients: PodCIDR})
		if pgErr == nil {
			progress(fmt.Sprintf("PostgreSQL    %s:%d", HostIP, s.Postgres.Port))
		}
	}()
	go func() {
		defer wg.Done()
		s.Kafka, kafkaErr = testenv.StartKafka(filepath.Join(dir, "kafka"), testenv.Listen{Host: HostIP})
		if kafkaErr == nil {
			progress("Kafka broker  " + s.Kafka.Addr())
		}
	}()
	go func() {
		defer wg.Done()
		s.Kube, kubeErr = testenv.StartKube(filepath.Join(dir, "kube"), testenv.KubeOptions{Host: HostIP, NoCRDs: opts.NoOperator})
		if kubeErr == nil {
			crds := ", CRDs installed"
			if opts.NoOperator {
				crds = ""
			}
			progress("kube-apiserver " + s.Kube.Config.Host + " (with etcd" + crds + ")")
		}
	}()
	go func() {
		defer wg.Done()
		images, imgErr = buildImages(ctx, filepath.Join(dir, "images"), filepath.Join(dir, "logs", "images.log"))
		if imgErr == nil {
			s.OperatorImage = images.operatorTag
			progress("images        " + s.OperatorImage + ", " + images.pauseTag + " (built with go-containerregistry)")
		}
	}()
	wg.Wait()
	if s.Postgres != nil {
		s.closers = append(s.closers, s.Postgres.Close)
	}
	if s.Kafka != nil {
		s.closers = append(s.closers, s.Kafka.Close)
	}
	if s.Kube != nil {
		s.closers = append(s.closers, s.Kube.Close)
	}
	if err := errors.Join(pgErr, kafkaErr, kubeErr, imgErr); err != nil {
		return s, err
	}
	if err := s.Kube.WriteKubeconfig(s.Kubeconfig); err != nil {
		return s, err
	}
	if s.Client, err = client.New(s.Kube.Config, client.Options{Scheme: Scheme()}); err != nil {
		return s, err
	}
	s.node, err = startNode(ctx, filepath.Join(dir, "node"), s.Kube, append(images.tarballs, opts.ExtraImages...), images.pauseTag)
	if err != nil {
		return s, fmt.Errorf("start the node: %w", err)
	}
	s.closers = append(s.closers, s.node.close)
	progress("node          " + NodeName + " Ready (kubelet, containerd, runc; kube-controller-manager, kube-scheduler, kube-proxy)")

	if opts.NoOperator {
		return s, nil
	}
	if err := s.installOperator(ctx); err != nil {
		return s, err
	}
	progress("operator      kubectl apply -k config/default (image " + s.OperatorImage + "), manager Available")
	return s, nil
}

// RestConfig is the admin REST config.
func (s *Stack) RestConfig() *rest.Config { return s.Kube.Config }

// KubectlPath is the kubectl built from the API server's Kubernetes version.
func (s *Stack) KubectlPath() string { return filepath.Join(s.Kube.AssetsDir, "kubectl") }

// Kubectl runs kubectl against the stack and returns its combined output.
func (s *Stack) Kubectl(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, s.KubectlPath(), args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+s.Kubeconfig)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("kubectl %v: %w\n%s", args, err, out)
	}
	return out, nil
}

// Close stops everything, in reverse order: the node (and every pod), the
// API server, Kafka, PostgreSQL, the bridge. It is safe to call twice.
func (s *Stack) Close() error {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.isClosed {
		return nil
	}
	s.isClosed = true
	var errs []error
	for i := len(s.closers) - 1; i >= 0; i-- {
		errs = append(errs, s.closers[i]())
	}
	return errors.Join(errs...)
}
