package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	outboxv1alpha1 "github.com/outbox-relay/outbox-operator/api/v1alpha1"
	"github.com/outbox-relay/outbox-operator/test/localcluster"
)

// snapshot is what one frame shows.
type snapshot struct {
	now                         time.Time
	rate                        float64
	written, published, backlog int64
	perSecond                   int64
	dbErr                       error
	serviceFailures             int64
	serviceErr                  string
	consumedCount               int64
	lastEvents                  []consumed
	relayFound                  bool
	ready                       string
	desired                     int32
	condition, reason           string
	lagging                     string // the Lagging condition's status and reason
	flow                        *outboxv1alpha1.BacklogStatus
	pods                        []localcluster.Pod
	burst                       string // the -autoscaling variant's bursts
}

func takeSnapshot(ctx context.Context, stack *localcluster.Stack, svc *orderService, t *tail, rate float64) snapshot {
	s := snapshot{now: time.Now(), rate: rate, perSecond: -1}
	s.written, s.published, s.backlog, s.dbErr = svc.counts(ctx)
	s.serviceFailures = svc.failures.Load()
	if e := svc.lastErr.Load(); e != nil {
		s.serviceErr = *e
	}
	s.consumedCount, s.lastEvents = t.snapshot()
	var obr outboxv1alpha1.OutboxRelay
	gctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := stack.Client.Get(gctx, types.NamespacedName{Namespace: "default", Name: "orders"}, &obr); err == nil {
		s.relayFound = true
		s.ready = obr.Status.Ready
		s.desired = ptr.Deref(obr.Spec.Replicas, 1)
		if obr.Spec.Autoscaling != nil {
			s.desired = obr.Status.DesiredReplicas
		}
		if c := meta.FindStatusCondition(obr.Status.Conditions, outboxv1alpha1.ConditionReady); c != nil {
			s.condition, s.reason = string(c.Status), c.Reason
		}
		if c := meta.FindStatusCondition(obr.Status.Conditions, outboxv1alpha1.ConditionLagging); c != nil {
			s.lagging = string(c.Status) + " " + c.Reason
		}
		s.flow = obr.Status.Backlog
	}
	s.pods, _ = stack.Pods(gctx, "default", "orders-relay")
	return s
}

func render(stack *localcluster.Stack, s snapshot) string {
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	rule := strings.Repeat("─", 78)
	line("outbox-operator demo: the whole system on this machine            %s", s.now.Format("15:04:05"))
	line("%s", rule)
	if s.rate > 0 {
		line(" order service      ConfirmOrder at %.0f/s (order update + outbox row, one transaction)", s.rate)
	}
	if s.burst != "" {
		line(" order service      %s", s.burst)
	}
	if s.serviceFailures > 0 {
		line("                    %d failed, last: %s", s.serviceFailures, trim(s.serviceErr, 60))
	}
	if s.dbErr != nil {
		line(" outbox             %s", trim(s.dbErr.Error(), 60))
	} else {
		rate := ""
		if s.perSecond >= 0 {
			rate = fmt.Sprintf("   (%d/s)", s.perSecond)
		}
		line(" events written     %8d", s.written)
		line(" events published   %8d%s", s.published, rate)
		line(" backlog            %8d", s.backlog)
	}
	line(" read from Kafka    %8d   (topic orders.confirmed, %d partitions)", s.consumedCount, localcluster.SampleTopics["orders.confirmed"])
	line("")
	if !s.relayFound {
		line(" OutboxRelay default/orders: not found (kubectl apply -f .demo/samples to bring it back)")
	} else {
		line(" OutboxRelay orders  replicas ready %s (desired %d)   Ready=%s %s", orDash(s.ready), s.desired, orDash(s.condition), s.reason)
		if f := s.flow; f != nil {
			// What the operator itself reads of the flow (status.backlog), as kubectl get obr shows it.
			perMinute := "–"
			if f.PublishedPerMinute != nil {
				perMinute = fmt.Sprint(*f.PublishedPerMinute)
			}
			line("   status.backlog   pending %d, oldest %s, %s/min, Lagging=%s (at %s)",
				f.Pending, f.OldestAge.Duration.Round(time.Millisecond), perMinute, orDash(s.lagging), f.ObservedAt.Format("15:04:05"))
		} else {
			line("   status.backlog   not observed yet")
		}
	}
	for _, p := range s.pods {
		state := "not ready"
		switch {
		case p.Terminating:
			state = "terminating"
		case p.Ready:
			state = "ready"
		}
		line("   pod %-32s %-11s restarts %d", p.Name, state, p.Restarts)
	}
	line("")
	line(" last events consumed from orders.confirmed")
	if len(s.lastEvents) == 0 {
		line("   (none yet)")
	}
	for i := len(s.lastEvents) - 1; i >= 0; i-- {
		e := s.lastEvents[i]
		line("   %s  p%d@%-6d event %s  order %s  %s  %d.%02d RUB", e.at.Format("15:04:05.000"), e.partition, e.offset,
			short(e.eventID), short(e.orderID), e.customer, e.kopecks/100, e.kopecks%100)
	}
	line("%s", rule)
	kubectl := stack.KubectlPath()
	line(" From another shell:")
	line("   export KUBECONFIG=%s", stack.Kubeconfig)
	line("   %s get obr", kubectl)
	if s.burst == "" {
		line("   %s scale obr/orders --replicas=3", kubectl)
	} else {
		line("   %s get events --field-selector involvedObject.name=orders", kubectl)
	}
	line("   %s get deploy,svc,pdb,secret", kubectl)
	line(" Logs: under %s (pods: node/pod-logs)   Ctrl-C stops everything.", stack.Dir)
	return b.String()
}

// short keeps the end of an id: UUIDv7s written in the same second share
// their start.
func short(id string) string {
	if len(id) > 12 {
		return "…" + id[len(id)-12:]
	}
	return id
}

func trim(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
