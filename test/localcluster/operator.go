package localcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/outbox-relay/outbox-operator/test/testenv"
)

// operatorNamespace is where config/default installs the manager.
const operatorNamespace = "outbox-system"

// localSecretRefresh is the local stack's --secret-refresh-interval.
const localSecretRefresh = 15 * time.Second

// installOperator applies config/default as a user does, through a
// kustomization that only pins the image (the manager's, and the relay
// image it gives OutboxRelays that name none), and waits until the
// manager's Deployment is available. The manager runs in a pod with its own
// service account and RBAC from config/rbac, so a missing rule fails.
func (s *Stack) installOperator(ctx context.Context) error {
	overlay := filepath.Join(s.Dir, "install")
	if err := os.MkdirAll(overlay, 0o755); err != nil {
		return err
	}
	i := strings.LastIndex(s.OperatorImage, ":")
	if i < 0 || strings.Contains(s.OperatorImage[i:], "/") {
		return fmt.Errorf("operator image %q has no tag", s.OperatorImage)
	}
	repo, tag := s.OperatorImage[:i], s.OperatorImage[i+1:]
	// kustomize takes a base only by a relative path.
	base, err := filepath.Rel(overlay, filepath.Join(testenv.RepoRoot(), "config", "default"))
	if err != nil {
		return err
	}
	kustomization := fmt.Sprintf(`# Written by the local stack: config/default with the locally built image.
resources:
  - %s
images:
  - name: %s
    newTag: %s
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata:
        name: outbox-operator-controller-manager
        namespace: %s
      spec:
        template:
          spec:
            containers:
              - name: manager
                env:
                  - name: RELAY_IMAGE
                    value: %s
  # A rotated Secret reaches the relay pods within seconds here, not the
  # default 5 minutes (the operator may only get Secrets, so it reads them
  # again on a schedule).
  - target:
      kind: Deployment
      name: outbox-operator-controller-manager
    patch: |-
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --secret-refresh-interval=%s
`, base, repo, tag, operatorNamespace, s.OperatorImage, localSecretRefresh)
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(kustomization), 0o644); err != nil {
		return err
	}
	if out, err := s.Kubectl(ctx, "apply", "-k", overlay); err != nil {
		return fmt.Errorf("install the operator: %w: %s", err, out)
	}
	return s.waitManager(ctx, 3*time.Minute)
}

// WaitManager waits until the manager's Deployment in outbox-system has an
// available, up-to-date replica.
func (s *Stack) WaitManager(ctx context.Context, timeout time.Duration) error {
	return s.waitManager(ctx, timeout)
}

// waitManager waits until the manager's Deployment has an available,
// up-to-date replica.
func (s *Stack) waitManager(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	why := "no Deployment"
	for {
		var list appsv1.DeploymentList
		if err := s.Client.List(ctx, &list, client.InNamespace(operatorNamespace),
			client.MatchingLabels{"app.kubernetes.io/component": "manager"}); err == nil && len(list.Items) == 1 {
			d := list.Items[0]
			if d.Status.ObservedGeneration == d.Generation && d.Status.AvailableReplicas >= 1 && d.Status.UpdatedReplicas == d.Status.Replicas {
				return nil
			}
			why = fmt.Sprintf("status %+v", d.Status)
		}
		if time.Now().After(deadline) {
			pods, _ := s.podSummary(ctx, operatorNamespace)
			return fmt.Errorf("the manager is not available within %s: %s; pods: %s (logs under %s)", timeout, why, pods, filepath.Join(s.Dir, "node", "pod-logs"))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// podSummary describes the pods of a namespace in one line, for errors.
func (s *Stack) podSummary(ctx context.Context, ns string) (string, error) {
	var pods corev1.PodList
	if err := s.Client.List(ctx, &pods, client.InNamespace(ns)); err != nil {
		return "", err
	}
	var b strings.Builder
	for _, p := range pods.Items {
		fmt.Fprintf(&b, "%s %s", p.Name, p.Status.Phase)
		for _, c := range p.Status.ContainerStatuses {
			switch {
			case c.State.Waiting != nil:
				fmt.Fprintf(&b, " [%s waiting: %s %s]", c.Name, c.State.Waiting.Reason, c.State.Waiting.Message)
			case c.State.Terminated != nil:
				fmt.Fprintf(&b, " [%s terminated: %s %s]", c.Name, c.State.Terminated.Reason, c.State.Terminated.Message)
			}
		}
		b.WriteString("; ")
	}
	return b.String(), nil
}

// Pod is what the tests and the demo read of a relay pod.
type Pod struct {
	Name string
	// Revision is the pod-template-hash label: pods of one rollout share it.
	Revision string
	Ready    bool
	Restarts int32
	// ContainerID is the relay container's containerd id.
	ContainerID string
	// Terminating is set once the pod is being deleted.
	Terminating bool
}

// Pods lists the pods of a Deployment, terminating ones included (a
// rollout is done once they are gone), in name order.
func (s *Stack) Pods(ctx context.Context, namespace, deployment string) ([]Pod, error) {
	var d appsv1.Deployment
	if err := s.Client.Get(ctx, client.ObjectKey{Namespace: namespace, Name: deployment}, &d); err != nil {
		return nil, client.IgnoreNotFound(err)
	}
	sel := labels.SelectorFromSet(d.Spec.Selector.MatchLabels)
	var list corev1.PodList
	if err := s.Client.List(ctx, &list, client.InNamespace(namespace), client.MatchingLabelsSelector{Selector: sel}); err != nil {
		return nil, err
	}
	out := make([]Pod, 0, len(list.Items))
	for _, p := range list.Items {
		pod := Pod{Name: p.Name, Revision: p.Labels[appsv1.DefaultDeploymentUniqueLabelKey], Terminating: p.DeletionTimestamp != nil}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady {
				pod.Ready = c.Status == corev1.ConditionTrue
			}
		}
		if len(p.Status.ContainerStatuses) > 0 {
			cs := p.Status.ContainerStatuses[0]
			pod.Restarts = cs.RestartCount
			pod.ContainerID = strings.TrimPrefix(cs.ContainerID, "containerd://")
		}
		out = append(out, pod)
	}
	return out, nil
}

// KillContainer sends SIGKILL to a container's process, as the kernel's OOM
// killer or a crash would end it; the kubelet restarts it.
func (s *Stack) KillContainer(ctx context.Context, containerID string) error {
	if out, err := s.node.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", containerID); err != nil {
		return fmt.Errorf("ctr tasks kill %s: %w: %s", containerID, err, out)
	}
	return nil
}
