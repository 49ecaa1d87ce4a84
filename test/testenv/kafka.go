package testenv

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// KafkaBroker is a single-node Apache Kafka broker (combined KRaft
// broker+controller) running on the machine's JVM.
type KafkaBroker struct {
	// Port is the client listener's port (at Addr's host).
	Port int
	// OAuthPort is a second client listener's port: SASL_SSL with
	// OAUTHBEARER, accepting the unsigned JWTs of UnsecuredJWT (Kafka's
	// built-in unsecured validator), its certificate for 127.0.0.1 and
	// localhost signed by CA.
	OAuthPort int
	// CA signed the OAUTHBEARER listener's certificate.
	CA *CA

	host     string
	dir      string
	libs     string
	props    string
	logFile  string
	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{}
	topicSeq atomic.Int64
	// transport is replaced at every Start: kafka-go caches connections per
	// transport, and those to a stopped broker answer with EOF.
	transport atomic.Pointer[kafka.Transport]
}

// TopicBytes is the size of a topic's log segments on the broker's disk:
// what its records take once the broker has them (compressed, if they were).
func (b *KafkaBroker) TopicBytes(topic string) (int64, error) {
	segs, err := filepath.Glob(filepath.Join(b.dir, "data", topic+"-*", "*.log"))
	if err != nil {
		return 0, err
	}
	var n int64
	for _, s := range segs {
		fi, err := os.Stat(s)
		if err != nil {
			return 0, err
		}
		n += fi.Size()
	}
	return n, nil
}

func (b *KafkaBroker) client(timeout time.Duration) *kafka.Client {
	return &kafka.Client{Addr: kafka.TCP(b.Addr()), Timeout: timeout, Transport: b.transport.Load()}
}

// StartKafka formats a KRaft storage folder under dir and starts the broker.
// With a Listen, the broker's client listener is at Listen.Host instead of
// 127.0.0.1, so that pods on a local node reach it (the machine reaches it
// there too).
func StartKafka(dir string, listen ...Listen) (*KafkaBroker, error) {
	libs, err := findDir("OUTBOX_KAFKA_LIBS", "make deps-kafka", "",
		filepath.Join(RepoRoot(), "bin", "kafka", "*", "libs"))
	if err != nil {
		return nil, fmt.Errorf("Kafka broker jars: %w", err)
	}
	if m, _ := filepath.Glob(filepath.Join(libs, "kafka_2.13-*.jar")); len(m) == 0 {
		return nil, fmt.Errorf("Kafka broker jars: no kafka_2.13-*.jar in %s; run `make deps-kafka`", libs)
	}
	if _, err := exec.LookPath(javaBin()); err != nil {
		return nil, fmt.Errorf("Kafka needs a JDK 17+ (java on PATH or $JAVA_HOME): %w", err)
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	cport, err := FreePort()
	if err != nil {
		return nil, err
	}
	oport, err := FreePort()
	if err != nil {
		return nil, err
	}
	ca, err := NewCA("outbox-test-kafka-ca")
	if err != nil {
		return nil, err
	}
	certPEM, keyPEM, err := ca.IssuePKCS8("kafka", "127.0.0.1", "localhost", listenOf(listen).Host)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	b := &KafkaBroker{Port: port, OAuthPort: oport, CA: ca, host: listenOf(listen).Host, dir: dir, libs: libs, props: filepath.Join(dir, "server.properties"), logFile: filepath.Join(dir, "kafka.log")}
	props := fmt.Sprintf(`process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:%[2]d
listeners=PLAINTEXT://%[4]s:%[1]d,CONTROLLER://127.0.0.1:%[2]d,OAUTH://%[4]s:%[5]d
advertised.listeners=PLAINTEXT://%[4]s:%[1]d,OAUTH://%[4]s:%[5]d
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,OAUTH:SASL_SSL
inter.broker.listener.name=PLAINTEXT
listener.name.oauth.sasl.enabled.mechanisms=OAUTHBEARER
listener.name.oauth.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;
listener.name.oauth.ssl.keystore.type=PEM
listener.name.oauth.ssl.keystore.certificate.chain=%[6]s
listener.name.oauth.ssl.keystore.key=%[7]s
log.dirs=%[3]s
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
min.insync.replicas=1
`, port, cport, filepath.Join(dir, "data"), b.host, oport, propertiesValue(certPEM), propertiesValue(keyPEM))
	if err := os.WriteFile(b.props, []byte(props), 0o644); err != nil {
		return nil, err
	}
	log4j := `status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = OUT
logger.kafka.name = kafka.server.KafkaRaftServer
logger.kafka.level = INFO
`
	if err := os.WriteFile(filepath.Join(dir, "log4j2.properties"), []byte(log4j), 0o644); err != nil {
		return nil, err
	}
	// A cluster id is a URL-safe base64 UUID; like Kafka's Uuid.randomUuid,
	// never one starting with "-", which the storage tool would read as a flag.
	var clusterID string
	for clusterID == "" || clusterID[0] == '-' {
		var id [16]byte
		_, _ = rand.Read(id[:])
		clusterID = base64.RawURLEncoding.EncodeToString(id[:])
	}
	format := b.java("kafka.tools.StorageTool", "format", "-t", clusterID, "-c", b.props, "--standalone")
	if out, err := format.CombinedOutput(); err != nil {
		// Older 4.x storage tools name the flag differently; a static quorum needs none.
		format = b.java("kafka.tools.StorageTool", "format", "-t", clusterID, "-c", b.props)
		if out2, err2 := format.CombinedOutput(); err2 != nil {
			return nil, fmt.Errorf("kafka storage format: %w\n%s\n%s", err2, out, out2)
		}
	}
	if err := b.Start(); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

// propertiesValue is s as a one-line Java properties value.
func propertiesValue(s []byte) string {
	return strings.ReplaceAll(strings.TrimSpace(string(s)), "\n", `\n`)
}

// OAuthAddr is the OAUTHBEARER listener's host:port.
func (b *KafkaBroker) OAuthAddr() string { return net.JoinHostPort(b.host, strconv.Itoa(b.OAuthPort)) }

// UnsecuredJWT is a token the OAUTHBEARER listener accepts: an unsigned
// JWT ("alg": "none") for subject, valid for ttl (expired when negative).
func UnsecuredJWT(subject string, ttl time.Duration) string {
	enc := base64.RawURLEncoding.EncodeToString
	now := time.Now()
	return enc([]byte(`{"alg":"none"}`)) + "." +
		enc(fmt.Appendf(nil, `{"sub":%q,"iat":%d,"exp":%d}`, subject, now.Unix(), now.Add(ttl).Unix())) + "."
}

func javaBin() string {
	if h := os.Getenv("JAVA_HOME"); h != "" {
		return filepath.Join(h, "bin", "java")
	}
	return "java"
}

func (b *KafkaBroker) java(mainClass string, args ...string) *exec.Cmd {
	heap := cmp.Or(os.Getenv("OUTBOX_KAFKA_HEAP"), "512m")
	jargs := []string{
		"-Xmx" + heap, "-Xms128m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
		"-Djava.awt.headless=true",
		"-Dlog4j2.configurationFile=" + filepath.Join(b.dir, "log4j2.properties"),
		"-cp", filepath.Join(b.libs, "*"), mainClass,
	}
	cmd := exec.Command(javaBin(), append(jargs, args...)...)
	cmd.Dir = b.dir
	return cmd
}

// Addr is the broker's host:port.
func (b *KafkaBroker) Addr() string { return net.JoinHostPort(b.host, strconv.Itoa(b.Port)) }

// Pid is the broker process's id, 0 while it is stopped.
func (b *KafkaBroker) Pid() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd == nil || b.cmd.Process == nil {
		return 0
	}
	return b.cmd.Process.Pid
}

// Start starts the broker process and waits until it serves metadata.
func (b *KafkaBroker) Start() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd != nil {
		return errors.New("kafka broker already running")
	}
	logf, err := os.OpenFile(b.logFile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	if old := b.transport.Load(); old != nil {
		old.CloseIdleConnections()
	}
	b.transport.Store(&kafka.Transport{})
	cmd := b.java("kafka.Kafka", b.props)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start kafka broker: %w", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(exited) }()
	b.cmd, b.exited = cmd, exited

	deadline := time.Now().Add(90 * time.Second)
	for {
		select {
		case <-exited:
			b.cmd = nil
			return fmt.Errorf("kafka broker exited during start-up; see %s", b.logFile)
		default:
		}
		if err := b.ping(); err == nil {
			return nil
		} else if time.Now().After(deadline) {
			return fmt.Errorf("kafka broker not ready after 90s (%v); see %s", err, b.logFile)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// ping succeeds once the broker answers metadata requests and has a controller.
func (b *KafkaBroker) ping() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	md, err := b.client(2*time.Second).Metadata(ctx, &kafka.MetadataRequest{})
	if err != nil {
		return err
	}
	if len(md.Brokers) == 0 || md.Controller.ID < 0 {
		return errors.New("no controller yet")
	}
	return nil
}

// Stop stops the broker with SIGTERM (a controlled shutdown) and waits.
func (b *KafkaBroker) Stop() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd == nil {
		return nil
	}
	_ = syscall.Kill(-b.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-b.exited:
	case <-time.After(30 * time.Second):
		_ = syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
		<-b.exited
	}
	b.cmd = nil
	return nil
}

// Close stops the broker.
func (b *KafkaBroker) Close() error { return b.Stop() }

var topicChars = regexp.MustCompile(`[^a-zA-Z0-9._-]+`)

// TopicName returns a topic name unique to the test (not created).
func (b *KafkaBroker) TopicName(t testing.TB, suffix string) string {
	return b.UniqueTopic(t.Name(), suffix)
}

// UniqueTopic returns a topic name no other call returns, made of prefix
// (cut to 80 characters, characters a topic name cannot hold replaced), a
// sequence number and suffix. The topic is not created.
func (b *KafkaBroker) UniqueTopic(prefix, suffix string) string {
	name := topicChars.ReplaceAllString(prefix, "_")
	if len(name) > 80 {
		name = name[:80]
	}
	return fmt.Sprintf("%s.%d.%s", name, b.topicSeq.Add(1), suffix)
}

// DeleteTopic deletes a topic, freeing the broker's disk.
func (b *KafkaBroker) DeleteTopic(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := b.client(20*time.Second).DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{name}})
	if err != nil {
		return fmt.Errorf("delete topic %s: %w", name, err)
	}
	if err := res.Errors[name]; err != nil {
		return fmt.Errorf("delete topic %s: %w", name, err)
	}
	return nil
}

// CreateTopic creates a topic with the given partitions and configs
// (e.g. "max.message.bytes"="10000") and waits until it has leaders.
func (b *KafkaBroker) CreateTopic(t testing.TB, name string, partitions int, configs ...string) {
	t.Helper()
	if err := b.CreateTopicErr(name, partitions, configs...); err != nil {
		t.Fatalf("create topic %s: %v", name, err)
	}
}

// CreateTopicErr is CreateTopic returning the error.
func (b *KafkaBroker) CreateTopicErr(name string, partitions int, configs ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var entries []kafka.ConfigEntry
	for i := 0; i+1 < len(configs); i += 2 {
		entries = append(entries, kafka.ConfigEntry{ConfigName: configs[i], ConfigValue: configs[i+1]})
	}
	c := b.client(20 * time.Second)
	res, err := c.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{
		Topic: name, NumPartitions: partitions, ReplicationFactor: 1, ConfigEntries: entries,
	}}})
	if err != nil {
		return err
	}
	if err := res.Errors[name]; err != nil && !errors.Is(err, kafka.TopicAlreadyExists) {
		return err
	}
	for {
		md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{name}})
		if err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil && len(md.Topics[0].Partitions) == partitions {
			ready := true
			for _, p := range md.Topics[0].Partitions {
				if p.Leader.ID < 0 {
					ready = false
				}
			}
			if ready {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("topic %s has no leaders yet: %w", name, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Consume reads a topic's partitions from the beginning until it holds at
// least want messages and no more arrive for settle (so duplicates are
// seen), or until timeout. It returns what it read, sorted by partition
// and offset; tests assert on the result.
func (b *KafkaBroker) Consume(t testing.TB, topic string, want int, timeout time.Duration) []kafka.Message {
	t.Helper()
	msgs, err := b.ConsumeErr(topic, want, timeout, time.Second)
	if err != nil {
		t.Fatalf("consume %s: %v", topic, err)
	}
	return msgs
}

// ConsumeErr is Consume with the settle time as a parameter, returning errors.
func (b *KafkaBroker) ConsumeErr(topic string, want int, timeout, settle time.Duration) ([]kafka.Message, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var (
		mu   sync.Mutex
		out  []kafka.Message
		last = time.Now()
	)
	r, err := b.ReadTopic(ctx, topic, func(m kafka.Message) {
		mu.Lock()
		out = append(out, m)
		last = time.Now()
		mu.Unlock()
	})
	if err != nil {
		return nil, err
	}
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case <-tick.C:
			mu.Lock()
			done := len(out) >= want && time.Since(last) >= settle
			mu.Unlock()
			if done {
				break loop
			}
		}
	}
	r.Close()
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Partition != out[j].Partition {
			return out[i].Partition < out[j].Partition
		}
		return out[i].Offset < out[j].Offset
	})
	return out, nil
}

// TopicReader reads a topic in the background; see ReadTopic.
type TopicReader struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// ReadTopic reads every partition of topic from its first offset, as an
// independent consumer does, and hands each message to fn until ctx ends or
// Close is called. fn runs on one goroutine per partition, so it must be
// safe for concurrent use; within a partition it sees messages in order.
func (b *KafkaBroker) ReadTopic(ctx context.Context, topic string, fn func(kafka.Message)) (*TopicReader, error) {
	parts, err := b.partitions(ctx, topic)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	tr := &TopicReader{cancel: cancel}
	for _, p := range parts {
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: []string{b.Addr()}, Topic: topic, Partition: p,
			Dialer:   &kafka.Dialer{Timeout: 10 * time.Second},
			MinBytes: 1, MaxBytes: 16 << 20, MaxWait: 100 * time.Millisecond,
			ReadLagInterval: -1, // no lag reports: they are extra requests nobody reads
		})
		if err := r.SetOffset(kafka.FirstOffset); err != nil {
			r.Close()
			tr.Close()
			return nil, fmt.Errorf("read topic %s partition %d: %w", topic, p, err)
		}
		tr.wg.Add(1)
		go func() {
			defer tr.wg.Done()
			defer r.Close()
			for {
				m, err := r.ReadMessage(ctx)
				if err != nil {
					return
				}
				fn(m)
			}
		}()
	}
	return tr, nil
}

// Close stops reading and returns once fn is no longer called.
func (r *TopicReader) Close() {
	r.cancel()
	r.wg.Wait()
}

func (b *KafkaBroker) partitions(ctx context.Context, topic string) ([]int, error) {
	md, err := b.client(10*time.Second).Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return nil, err
	}
	if len(md.Topics) != 1 || md.Topics[0].Error != nil {
		return nil, fmt.Errorf("topic %s: %v", topic, md.Topics)
	}
	var ps []int
	for _, p := range md.Topics[0].Partitions {
		ps = append(ps, p.ID)
	}
	sort.Ints(ps)
	return ps, nil
}

// Header returns the value of a message header, or "".
func Header(m kafka.Message, key string) string {
	for _, h := range m.Headers {
		if strings.EqualFold(h.Key, key) {
			return string(h.Value)
		}
	}
	return ""
}
