package monitoring

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"
)

// expression is a PromQL expression and where it comes from.
type expression struct {
	where, expr string
}

// prometheusRule is the part of a PrometheusRule the tests read.
type prometheusRule struct {
	Spec struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Alert       string            `json:"alert"`
				Record      string            `json:"record"`
				Expr        string            `json:"expr"`
				Annotations map[string]string `json:"annotations"`
			} `json:"rules"`
		} `json:"groups"`
	} `json:"spec"`
}

func readRule(t *testing.T) prometheusRule {
	t.Helper()
	b, err := os.ReadFile(repo("config", "prometheus", "prometheusrule.yaml"))
	require.NoError(t, err)
	var pr prometheusRule
	require.NoError(t, yaml.Unmarshal(b, &pr))
	require.NotEmpty(t, pr.Spec.Groups)
	return pr
}

// ruleExpressions are the expressions of every rule in config/prometheus.
func ruleExpressions(t *testing.T) []expression {
	t.Helper()
	var out []expression
	for _, g := range readRule(t).Spec.Groups {
		for _, r := range g.Rules {
			out = append(out, expression{"config/prometheus alert " + r.Alert + r.Record, r.Expr})
		}
	}
	return out
}

// dashboardExpressions are the queries of every panel of the dashboard and
// the selectors of its template variables (label_values(SELECTOR, label)).
func dashboardExpressions(t *testing.T) []expression {
	t.Helper()
	b, err := os.ReadFile(repo("config", "grafana", "outbox-operator-dashboard.json"))
	require.NoError(t, err)
	type panel struct {
		Title   string `json:"title"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
		Panels []json.RawMessage `json:"panels"`
	}
	var dash struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(b, &dash))
	var out []expression
	var walk func([]json.RawMessage)
	walk = func(raw []json.RawMessage) {
		for _, r := range raw {
			var p panel
			require.NoError(t, json.Unmarshal(r, &p))
			for _, tg := range p.Targets {
				out = append(out, expression{"config/grafana panel " + p.Title, tg.Expr})
			}
			walk(p.Panels)
		}
	}
	walk(dash.Panels)
	labelValues := regexp.MustCompile(`^label_values\((.*),\s*\w+\)$`)
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		q, _ := v.Query.(map[string]any)
		m := labelValues.FindStringSubmatch(q["query"].(string))
		require.NotNil(t, m, "variable %s: want label_values(SELECTOR, label)", v.Name)
		out = append(out, expression{"config/grafana variable " + v.Name, m[1]})
	}
	require.NotEmpty(t, out)
	return out
}

// grafanaVariable matches $name and ${name} in a dashboard query.
var grafanaVariable = regexp.MustCompile(`\$\{?(\w+)\}?`)

// promQL replaces Grafana's variables with what Grafana would put there: a
// duration for the interval variables, a regular expression for the others
// (every one of ours is used in a =~ matcher).
func promQL(expr string) string {
	return grafanaVariable.ReplaceAllStringFunc(expr, func(v string) string {
		if strings.HasPrefix(strings.Trim(v, "${}"), "__") {
			return "5m"
		}
		return ".*"
	})
}

// selected is a metric an expression reads and the labels it uses on it.
type selected struct {
	metric string
	labels map[string]bool
}

// selectedMetrics parses expr and returns, per vector selector, the metric
// name and the labels the expression matches on or groups by.
func selectedMetrics(expr string) ([]selected, error) {
	node, err := parser.NewParser(parser.Options{}).ParseExpr(promQL(expr))
	if err != nil {
		return nil, err
	}
	var out []selected
	parser.Inspect(node, func(n parser.Node, path []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		s := selected{metric: vs.Name, labels: map[string]bool{}}
		for _, m := range vs.LabelMatchers {
			if m.Name == "__name__" {
				s.metric = m.Value
				continue
			}
			s.labels[m.Name] = true
		}
		for _, p := range path {
			if agg, ok := p.(*parser.AggregateExpr); ok && !agg.Without {
				for _, l := range agg.Grouping {
					s.labels[l] = true
				}
			}
		}
		out = append(out, s)
		return nil
	})
	return out, nil
}

// TestExpressionsParse: every rule and dashboard expression is valid PromQL
// to Prometheus' own parser, and reads at least one metric.
func TestExpressionsParse(t *testing.T) {
	t.Parallel()
	exprs := append(ruleExpressions(t), dashboardExpressions(t)...)
	require.Greater(t, len(exprs), 20)
	for _, e := range exprs {
		sel, err := selectedMetrics(e.expr)
		require.NoError(t, err, "%s: %s", e.where, e.expr)
		require.NotEmpty(t, sel, "%s reads no metric", e.where)
		for _, s := range sel {
			require.NotEmpty(t, s.metric, "%s: a selector without a metric name", e.where)
		}
	}
	_, err := selectedMetrics(`sum by (namespace) (rate(outbox_relay_batches_total[5m])`)
	require.Error(t, err, "the parser refuses a broken expression")
}

// TestEveryAlertHasARunbook: each alert links to its runbook section, and
// docs/metrics.md has that section.
func TestEveryAlertHasARunbook(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(repo("docs", "metrics.md"))
	require.NoError(t, err)
	start := strings.Index(string(doc), "\n## Runbooks\n")
	require.GreaterOrEqual(t, start, 0, "docs/metrics.md has a Runbooks section")
	runbooks := string(doc)[start:]
	for _, g := range readRule(t).Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			anchor := strings.ToLower(r.Alert)
			require.True(t, strings.HasSuffix(r.Annotations["runbook_url"], "docs/metrics.md#"+anchor), r.Alert)
			require.Contains(t, runbooks, "\n### "+r.Alert+"\n", "docs/metrics.md has no runbook for %s", r.Alert)
		}
	}
}

// TestDashboardLayout checks what Grafana needs to show the dashboard: unique
// panel ids, panels inside the 24-column grid, a query (with a refId) in
// every panel but the rows, and every variable a query uses defined.
func TestDashboardLayout(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(repo("config", "grafana", "outbox-operator-dashboard.json"))
	require.NoError(t, err)
	var dash struct {
		UID    string `json:"uid"`
		Panels []struct {
			ID      int                      `json:"id"`
			Type    string                   `json:"type"`
			Title   string                   `json:"title"`
			GridPos struct{ X, Y, W, H int } `json:"gridPos"`
			Targets []struct {
				Expr  string `json:"expr"`
				RefID string `json:"refId"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name string `json:"name"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(b, &dash))
	require.NotEmpty(t, dash.UID)
	defined := map[string]bool{"__rate_interval": true, "__interval": true, "__range": true}
	for _, v := range dash.Templating.List {
		defined[v.Name] = true
	}
	ids := map[int]bool{}
	for _, p := range dash.Panels {
		require.False(t, ids[p.ID], "panel id %d repeats", p.ID)
		ids[p.ID] = true
		require.True(t, p.GridPos.X >= 0 && p.GridPos.W > 0 && p.GridPos.X+p.GridPos.W <= 24 && p.GridPos.H > 0, "%s: %+v", p.Title, p.GridPos)
		if p.Type == "row" {
			continue
		}
		require.NotEmpty(t, p.Targets, p.Title)
		for _, tg := range p.Targets {
			require.NotEmpty(t, tg.RefID, p.Title)
			for _, m := range grafanaVariable.FindAllStringSubmatch(tg.Expr, -1) {
				require.True(t, defined[m[1]], "%s uses $%s, which the dashboard does not define", p.Title, m[1])
			}
		}
	}
}
