package localcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/outbox-relay/outbox-operator/internal/devproc"
	"github.com/outbox-relay/outbox-operator/internal/relayconfig"
)

// pod is one replica of a Deployment: a slot the runner keeps a process in.
// When its process dies the runner restarts it in the same slot (as the
// kubelet restarts a container), with a back-off.
type pod struct {
	name     string
	revision string
	template corev1.PodTemplateSpec
	proc     *process // nil between a crash and the restart
	restarts int
	// restartAt is when a crashed pod may start again.
	restartAt time.Time
	// lastErr is why the last start failed (a missing Secret, say).
	lastErr error
}

func (p *pod) ready() bool { return p.proc != nil && p.proc.ready.Load() && !p.proc.HasExited() }

// process is one running relay, probed for readiness as the kubelet does.
type process struct {
	*devproc.Proc
	logPath   string
	env       []string
	started   time.Time
	ready     atomic.Bool
	stopProbe context.CancelFunc
}

// startProcess runs the pod template's first container whose command the
// runner maps to a local binary. It resolves the environment (secretKeyRef,
// configMapKeyRef, plain values) and replaces --metrics-addr with a free
// loopback port. Volumes are not mounted: the relay needs none locally.
func (r *Runner) startProcess(ctx context.Context, ns string, p *pod, onChange func()) (*process, error) {
	var c *corev1.Container
	var bin string
	for i := range p.template.Spec.Containers {
		cc := &p.template.Spec.Containers[i]
		if len(cc.Command) > 0 && r.opts.Commands[cc.Command[0]] != "" {
			c, bin = cc, r.opts.Commands[cc.Command[0]]
			break
		}
	}
	if c == nil {
		return nil, fmt.Errorf("no container of the pod template has a command the pod runner maps to a local binary (%v)", keys(r.opts.Commands))
	}
	env, err := r.resolveEnv(ctx, ns, c.Env)
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(r.opts.LogDir, fmt.Sprintf("%s_%s_%d.log", ns, p.name, p.restarts))
	readyPath := ""
	if pr := c.ReadinessProbe; pr != nil && pr.HTTPGet != nil {
		readyPath = pr.HTTPGet.Path
	}
	dp, err := devproc.Start(devproc.Options{
		Binary: bin,
		Args:   append(append([]string{}, c.Command[1:]...), c.Args...),
		// A pod sees only its own environment, not the runner's.
		Env:       append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.TempDir()}, env...),
		AddrFlag:  "--" + relayconfig.FlagMetricsAddr,
		ReadyPath: readyPath,
		LogPath:   logPath,
	})
	if err != nil {
		return nil, err
	}
	probeCtx, stopProbe := context.WithCancel(context.Background())
	proc := &process{Proc: dp, logPath: logPath, env: env, started: time.Now(), stopProbe: stopProbe}
	r.liveMu.Lock()
	r.live[proc] = struct{}{}
	r.liveMu.Unlock()
	go func() {
		<-dp.Exited()
		r.liveMu.Lock()
		delete(r.live, proc)
		r.liveMu.Unlock()
		stopProbe()
		proc.ready.Store(false)
		onChange()
	}()
	go proc.probe(probeCtx, onChange)
	return proc, nil
}

// probe polls the readiness endpoint every 250ms (the relay template says
// every 10s; locally a faster probe keeps the demo and the test brisk).
func (p *process) probe(ctx context.Context, onChange func()) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		ok := p.Ready()
		if p.ready.Swap(ok) != ok {
			onChange()
		}
	}
}

// terminate stops the process as the kubelet stops a container: SIGTERM,
// then SIGKILL after the grace period. It returns at once; Exited closes
// when the process is gone.
func (p *process) terminate(grace time.Duration) {
	p.stopProbe()
	p.ready.Store(false)
	go p.Stop(grace)
}

// resolveEnv turns a container's env into NAME=value strings, reading
// secretKeyRef and configMapKeyRef from the API server as the kubelet does
// when it creates a container.
func (r *Runner) resolveEnv(ctx context.Context, ns string, vars []corev1.EnvVar) ([]string, error) {
	var out []string
	for _, v := range vars {
		val := v.Value
		switch from := v.ValueFrom; {
		case from == nil:
		case from.SecretKeyRef != nil:
			ref := from.SecretKeyRef
			var sec corev1.Secret
			if err := r.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: ref.Name}, &sec); err != nil {
				if client.IgnoreNotFound(err) == nil && ref.Optional != nil && *ref.Optional {
					continue
				}
				return nil, fmt.Errorf("env %s: secret %s: %w", v.Name, ref.Name, err)
			}
			b, ok := sec.Data[ref.Key]
			if !ok {
				return nil, fmt.Errorf("env %s: secret %s has no key %s", v.Name, ref.Name, ref.Key)
			}
			val = string(b)
		case from.ConfigMapKeyRef != nil:
			ref := from.ConfigMapKeyRef
			var cm corev1.ConfigMap
			if err := r.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: ref.Name}, &cm); err != nil {
				return nil, fmt.Errorf("env %s: configmap %s: %w", v.Name, ref.Name, err)
			}
			s, ok := cm.Data[ref.Key]
			if !ok {
				return nil, fmt.Errorf("env %s: configmap %s has no key %s", v.Name, ref.Name, ref.Key)
			}
			val = s
		default:
			return nil, fmt.Errorf("env %s: only value, secretKeyRef and configMapKeyRef are supported by the local pod runner", v.Name)
		}
		out = append(out, v.Name+"="+val)
	}
	return out, nil
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
