package kafkaauth_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/stretchr/testify/require"

	"github.com/outbox-relay/outbox-operator/kafkaauth"
)

// The client's first OAUTHBEARER message is RFC 7628's: the GS2 header,
// then auth=Bearer <token> between \x01 separators; the file's token is
// read again for each connection; a broker's error status ends the exchange.
func TestOAuthBearerMessages(t *testing.T) {
	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte("first.jwt.\n"), 0o600))
	m := kafkaauth.OAuthBearer{Token: kafkaauth.FileToken(file)}
	require.Equal(t, "OAUTHBEARER", m.Name())
	sess, ir, err := m.Start(context.Background())
	require.NoError(t, err)
	require.Equal(t, "n,,\x01auth=Bearer first.jwt.\x01\x01", string(ir))
	done, resp, err := sess.Next(context.Background(), nil)
	require.True(t, done)
	require.Nil(t, resp)
	require.NoError(t, err)
	_, _, err = sess.Next(context.Background(), []byte(`{"status":"invalid_token"}`))
	require.ErrorContains(t, err, `refused by the broker: {"status":"invalid_token"}`)

	require.NoError(t, os.WriteFile(file, []byte("second.jwt."), 0o600))
	_, ir, err = m.Start(context.Background())
	require.NoError(t, err)
	require.Contains(t, string(ir), "Bearer second.jwt.\x01")

	require.NoError(t, os.WriteFile(file, []byte("  \n"), 0o600))
	_, _, err = m.Start(context.Background())
	require.ErrorContains(t, err, "is empty")
	_, _, err = kafkaauth.OAuthBearer{Token: func(context.Context) (string, error) { return "a b", nil }}.Start(context.Background())
	require.ErrorContains(t, err, "holds a space")
	_, _, err = kafkaauth.OAuthBearer{Token: func(context.Context) (string, error) { return "", errors.New("idp down") }}.Start(context.Background())
	require.ErrorContains(t, err, "idp down")
}

// AWS_MSK_IAM is signed locally: the first message is MSK's JSON with the
// SigV4 presigned kafka-cluster:Connect for the broker's host, with the
// credential scope of the region and service kafka-cluster.
func TestMSKIAMSignsOffline(t *testing.T) {
	m := kafkaauth.NewMSKIAM("eu-west-1", credentials.NewStaticCredentialsProvider("AKIDEXAMPLE", "secret", ""))
	require.Equal(t, "AWS_MSK_IAM", m.Name())
	ctx := sasl.WithMetadata(context.Background(), &sasl.Metadata{Host: "b-1.orders.kafka.eu-west-1.amazonaws.com", Port: 9098})
	_, ir, err := m.Start(ctx)
	require.NoError(t, err)
	var msg map[string]string
	require.NoError(t, json.Unmarshal(ir, &msg))
	require.Equal(t, "2020_10_22", msg["version"])
	require.Equal(t, "b-1.orders.kafka.eu-west-1.amazonaws.com", msg["host"])
	require.Equal(t, "kafka-cluster:Connect", msg["action"])
	require.Equal(t, "AWS4-HMAC-SHA256", msg["x-amz-algorithm"])
	require.Regexp(t, `^AKIDEXAMPLE/\d{8}/eu-west-1/kafka-cluster/aws4_request$`, msg["x-amz-credential"])
	require.Regexp(t, `^[0-9a-f]{64}$`, msg["x-amz-signature"])
	require.Equal(t, "host", msg["x-amz-signedheaders"])
	_, err = url.ParseQuery("X-Amz-Date=" + msg["x-amz-date"])
	require.NoError(t, err)

	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "none"))
	_, err = kafkaauth.MSKIAM(context.Background(), "")
	require.ErrorContains(t, err, "no AWS region")
	_, err = kafkaauth.MSKIAM(context.Background(), "us-east-2")
	require.NoError(t, err)
}

// A token endpoint that takes the request and never answers fails it after
// TokenRequestTimeout, twice: until one succeeds, the library tries both
// ways of sending the client's credentials. Before, the request, and the
// broker connection that waited for its token, waited for ever.
func TestClientCredentialsGivesUpOnASilentEndpoint(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { <-release }))
	t.Cleanup(func() { close(release); srv.Close() })
	token := kafkaauth.ClientCredentials(srv.URL, "relay-client", "s3cret", "kafka")
	done := make(chan error, 1)
	go func() { _, err := token(context.Background()); done <- err }()
	select {
	case err := <-done:
		require.Error(t, err)
	case <-time.After(2*kafkaauth.TokenRequestTimeout + 10*time.Second):
		t.Fatal("the token request still waits")
	}
}
