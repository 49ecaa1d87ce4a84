package dbauth_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"
	"golang.org/x/oauth2"

	"github.com/outbox-relay/outbox-operator/dbauth"
	"github.com/outbox-relay/outbox-operator/relayconfig"
)

// The RDS token is a SigV4 presigned "connect" request for the user at
// host:port, signed locally for the rds-db service in the region, valid
// 15 minutes, without a scheme (RDS's documented shape).
func TestAWSRDSIAMTokenShape(t *testing.T) {
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "none"))
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(t.TempDir(), "none"))
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
	t.Setenv("AWS_REGION", "us-east-1")
	p, err := dbauth.NewAWSRDSIAM(context.Background(), "eu-west-1")
	require.NoError(t, err)
	require.Equal(t, "eu-west-1", p.Region, "the configured region wins over AWS_REGION")
	before := time.Now()
	tok, err := p.Token(context.Background(), dbauth.Target{Host: "orders.abc.eu-west-1.rds.amazonaws.com", Port: 5432, User: "relay"})
	require.NoError(t, err)
	require.WithinDuration(t, before.Add(dbauth.AWSTokenLifetime), tok.Expiry, 5*time.Second)
	require.False(t, strings.HasPrefix(tok.Value, "http"), tok.Value)
	hostPort, query, ok := strings.Cut(tok.Value, "?")
	require.True(t, ok, tok.Value)
	require.Equal(t, "orders.abc.eu-west-1.rds.amazonaws.com:5432", hostPort)
	q, err := url.ParseQuery(query)
	require.NoError(t, err)
	require.Equal(t, "connect", q.Get("Action"))
	require.Equal(t, "relay", q.Get("DBUser"))
	require.Equal(t, "AWS4-HMAC-SHA256", q.Get("X-Amz-Algorithm"))
	require.Equal(t, "900", q.Get("X-Amz-Expires"))
	require.Regexp(t, `^AKIDEXAMPLE/\d{8}/eu-west-1/rds-db/aws4_request$`, q.Get("X-Amz-Credential"))
	require.Regexp(t, `^[0-9a-f]{64}$`, q.Get("X-Amz-Signature"))

	// The same provider signs with whatever credentials it is given.
	p.Credentials = credentials.NewStaticCredentialsProvider("AKIDOTHER", "secret", "session")
	tok, err = p.Token(context.Background(), dbauth.Target{Host: "db", Port: 6432, User: "relay"})
	require.NoError(t, err)
	require.Contains(t, tok.Value, "X-Amz-Security-Token=session")
	require.True(t, strings.HasPrefix(tok.Value, "db:6432?"), tok.Value)

	t.Setenv("AWS_REGION", "")
	_, err = dbauth.New(context.Background(), relayconfig.DatabaseAuthAWSRDSIAM, "")
	require.ErrorContains(t, err, "no AWS region")
}

// A token signed with temporary credentials is good only while they are:
// its expiry is theirs when they end within its 15 minutes, so the Source
// fetches another then. Before, it kept handing the token out for up to 11
// minutes after RDS began to refuse it.
func TestAWSRDSIAMTokenEndsWithItsCredentials(t *testing.T) {
	p := &dbauth.AWSRDSIAM{Region: "eu-west-1"}
	ends := time.Now().Add(40 * time.Second)
	p.Credentials = aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
		return aws.Credentials{AccessKeyID: "ASIATEMP", SecretAccessKey: "secret", SessionToken: "session", CanExpire: true, Expires: ends}, nil
	})
	tok, err := p.Token(context.Background(), dbauth.Target{Host: "db", Port: 5432, User: "relay"})
	require.NoError(t, err)
	require.Equal(t, ends, tok.Expiry, "the credentials end before the token's 15 minutes")
	require.Contains(t, tok.Value, "ASIATEMP", "signed with those credentials")

	ends = time.Now().Add(time.Hour)
	tok, err = p.Token(context.Background(), dbauth.Target{Host: "db", Port: 5432, User: "relay"})
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(dbauth.AWSTokenLifetime), tok.Expiry, 5*time.Second, "credentials that outlive it")
}

// Cloud SQL IAM: the application default credentials (here a service
// account key whose token endpoint is local) are asked for the
// sqlservice.login scope, and the access token and its expiry are handed out.
func TestGCPCloudSQLIAMToken(t *testing.T) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	var scopes []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		require.NoError(t, r.ParseForm())
		claims := jwt.MapClaims{}
		_, err := jwt.ParseWithClaims(r.Form.Get("assertion"), claims, func(*jwt.Token) (any, error) { return &key.PublicKey, nil })
		require.NoError(t, err, "the assertion is signed with the service account's key")
		scopes = append(scopes, claims["scope"].(string))
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"access_token": "ya29.test", "token_type": "Bearer", "expires_in": 3600})
	}))
	t.Cleanup(srv.Close)
	sa, err := json.Marshal(map[string]string{
		"type": "service_account", "project_id": "p", "private_key_id": "k1",
		"private_key":  string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: must(x509.MarshalPKCS8PrivateKey(key))})),
		"client_email": "relay@p.iam.gserviceaccount.com", "client_id": "1", "token_uri": srv.URL,
	})
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "sa.json")
	require.NoError(t, os.WriteFile(file, sa, 0o600))
	t.Setenv("GOOGLE_APPLICATION_CREDENTIALS", file)

	p, err := dbauth.New(context.Background(), relayconfig.DatabaseAuthGCPCloudSQLIAM, "")
	require.NoError(t, err)
	before := time.Now()
	tok, err := p.Token(context.Background(), dbauth.Target{Host: "10.0.0.3", Port: 5432, User: "relay@p.iam"})
	require.NoError(t, err)
	require.Equal(t, "ya29.test", tok.Value)
	require.WithinDuration(t, before.Add(time.Hour), tok.Expiry, time.Minute)
	require.Equal(t, []string{dbauth.GCPCloudSQLScope}, scopes)
}

// Credentials that refresh through the token endpoint with the context
// they were found with (a user's, an external account's: workload
// identity federation) keep working after the context that bounded
// making the provider ends, as the operator's does. Before, every token
// request of such a provider failed with "context canceled".
func TestGCPCloudSQLIAMOutlivesTheContextItWasMadeWith(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"access_token": "ya29.user", "token_type": "Bearer", "expires_in": 3600})
	}))
	t.Cleanup(srv.Close)
	user, err := json.Marshal(map[string]string{
		"type": "authorized_user", "client_id": "1", "client_secret": "s", "refresh_token": "r", "token_uri": srv.URL,
	})
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "user.json")
	require.NoError(t, os.WriteFile(file, user, 0o600))
	t.Setenv("GOOGLE_APPLICATION_CREDENTIALS", file)

	ctx, cancel := context.WithCancel(context.Background())
	p, err := dbauth.New(ctx, relayconfig.DatabaseAuthGCPCloudSQLIAM, "")
	require.NoError(t, err)
	cancel()
	tok, err := p.Token(context.Background(), dbauth.Target{Host: "10.0.0.3", Port: 5432, User: "relay@p.iam"})
	require.NoError(t, err)
	require.Equal(t, "ya29.user", tok.Value)
}

// blockedTokens is a token source whose call does not return until
// released, as a metadata server that stopped answering.
type blockedTokens struct{ release chan struct{} }

func (b blockedTokens) Token() (*oauth2.Token, error) {
	<-b.release
	return &oauth2.Token{AccessToken: "ya29.late", Expiry: time.Now().Add(time.Hour)}, nil
}

// A token source that does not answer holds a caller only until its
// context ends. Before, the source's call took no context and the caller
// (a connection being opened) waited for as long as the call did.
func TestGCPCloudSQLIAMGivesUpWithItsCaller(t *testing.T) {
	src := blockedTokens{release: make(chan struct{})}
	t.Cleanup(func() { close(src.release) })
	p := &dbauth.GCPCloudSQLIAM{Tokens: src}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := p.Token(ctx, dbauth.Target{Host: "10.0.0.3", Port: 5432, User: "relay@p.iam"})
		done <- err
	}()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorContains(t, err, "gcp-cloudsql-iam")
	case <-time.After(10 * time.Second): // far past the caller's 200 ms
		t.Fatal("the token request outlived its caller's context by 10 s")
	}
}

// A service account key's token endpoint that takes the request and never
// answers: the request ends with its HTTP client's timeout, and the login
// with it. Before, net/http's client had none: the request, and every
// later login behind the token source's lock, waited for good.
func TestGCPTokenRequestToAnEndpointThatNeverAnswersEnds(t *testing.T) {
	hung := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hung:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(hung) })
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	der, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	creds, err := json.Marshal(map[string]string{
		"type": "service_account", "client_email": "relay@p.iam.gserviceaccount.com", "private_key_id": "k1",
		"private_key": string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})), "token_uri": srv.URL,
	})
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "key.json")
	require.NoError(t, os.WriteFile(file, creds, 0o600))
	t.Setenv("GOOGLE_APPLICATION_CREDENTIALS", file)
	t.Cleanup(dbauth.SetGCPTokenRequestTimeout(300 * time.Millisecond))

	p, err := dbauth.NewGCPCloudSQLIAM(context.Background())
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := p.Token(context.Background(), dbauth.Target{Host: "10.0.0.3", Port: 5432, User: "relay@p.iam"})
		done <- err
	}()
	select {
	case err := <-done:
		require.ErrorContains(t, err, "gcp-cloudsql-iam")
		require.ErrorContains(t, err, "Client.Timeout exceeded")
	case <-time.After(10 * time.Second): // far past the 300 ms timeout
		t.Fatal("the token request to an endpoint that never answers did not end in 10 s")
	}
}

// azureCredential records the scopes it is asked for.
type azureCredential struct{ scopes [][]string }

func (c *azureCredential) GetToken(_ context.Context, o policy.TokenRequestOptions) (azcore.AccessToken, error) {
	c.scopes = append(c.scopes, o.Scopes)
	return azcore.AccessToken{Token: "eyJ.entra", ExpiresOn: time.Unix(1_900_000_000, 0)}, nil
}

// Azure AD: the credential is asked for Azure Database for PostgreSQL's
// scope, and its token and expiry are handed out.
func TestAzureADToken(t *testing.T) {
	cred := &azureCredential{}
	tok, err := (&dbauth.AzureAD{Credential: cred}).Token(context.Background(), dbauth.Target{Host: "x.postgres.database.azure.com", Port: 5432, User: "relay"})
	require.NoError(t, err)
	require.Equal(t, dbauth.Token{Value: "eyJ.entra", Expiry: time.Unix(1_900_000_000, 0)}, tok)
	require.Equal(t, [][]string{{dbauth.AzureADScope}}, cred.scopes)
	_, err = dbauth.New(context.Background(), relayconfig.DatabaseAuthAzureAD, "")
	require.NoError(t, err, "the default chain builds without an identity; a token request says what is missing")
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
