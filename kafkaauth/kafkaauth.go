// Package kafkaauth is the relay's Kafka SASL mechanisms beyond a user
// name and password: OAUTHBEARER (RFC 7628) with a token from a file the
// platform refreshes or from an OAuth 2.0 token endpoint, and AWS MSK IAM
// (kafka-go's own mechanism, signed with the pod's AWS identity). Each new
// connection authenticates with a token current at that moment.
package kafkaauth

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	signer "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/aws_msk_iam_v2"
	"golang.org/x/oauth2"
	"golang.org/x/oauth2/clientcredentials"
)

// OAuthBearer is SASL/OAUTHBEARER: the client's first message carries
// the bearer token (RFC 7628 section 3.1), which Token fetches for each
// new connection.
type OAuthBearer struct {
	Token func(ctx context.Context) (string, error)
}

// Name is the mechanism's SASL name.
func (OAuthBearer) Name() string { return "OAUTHBEARER" }

// Start sends the token.
func (m OAuthBearer) Start(ctx context.Context) (sasl.StateMachine, []byte, error) {
	tok, err := m.Token(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("OAUTHBEARER token: %w", err)
	}
	if tok == "" || strings.ContainsAny(tok, "\x01 ") {
		return nil, nil, errors.New("OAUTHBEARER token: empty, or holds a space or \\x01")
	}
	return bearerSession{}, []byte("n,,\x01auth=Bearer " + tok + "\x01\x01"), nil
}

type bearerSession struct{}

// Next ends the exchange: an empty challenge is success, anything else is
// the broker's error status (a JSON object, RFC 7628 section 3.2.2).
func (bearerSession) Next(_ context.Context, challenge []byte) (bool, []byte, error) {
	if len(challenge) == 0 {
		return true, nil, nil
	}
	return false, nil, fmt.Errorf("OAUTHBEARER refused by the broker: %s", challenge)
}

// FileToken reads the token from path for every new connection, so a
// token the platform rewrites there (a projected service account token, a
// sidecar's refresh) is used from the next connection on.
func FileToken(path string) func(context.Context) (string, error) {
	return func(context.Context) (string, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return "", err
		}
		tok := strings.TrimSpace(string(b))
		if tok == "" {
			return "", fmt.Errorf("%s is empty", path)
		}
		return tok, nil
	}
}

// TokenRequestTimeout bounds one request to an OAuth 2.0 token endpoint
// (ClientCredentials). Without a bound an endpoint that took the
// connection and never answered held every new broker connection, whose
// token the request was for, for ever.
const TokenRequestTimeout = 10 * time.Second

// ClientCredentials fetches tokens from an OAuth 2.0 token endpoint with
// the client credentials grant, reusing each until shortly before it
// expires.
func ClientCredentials(endpoint, clientID, clientSecret, scope string) func(context.Context) (string, error) {
	cfg := clientcredentials.Config{ClientID: clientID, ClientSecret: clientSecret, TokenURL: endpoint}
	if scope != "" {
		cfg.Scopes = strings.Fields(scope)
	}
	// The token source keeps this context's client for every request.
	ctx := context.WithValue(context.Background(), oauth2.HTTPClient, &http.Client{Timeout: TokenRequestTimeout})
	tokens := cfg.TokenSource(ctx) // cached: a new token only when this one expires
	return func(context.Context) (string, error) {
		tok, err := tokens.Token()
		if err != nil {
			return "", err
		}
		return tok.AccessToken, nil
	}
}

// MSKIAM is AWS_MSK_IAM signed with the SDK's default credentials (on EKS
// the pod's web identity or EKS Pod Identity); region, when not empty,
// overrides the SDK's (AWS_REGION).
func MSKIAM(ctx context.Context, region string) (sasl.Mechanism, error) {
	var opts []func(*awsconfig.LoadOptions) error
	if region != "" {
		opts = append(opts, awsconfig.WithRegion(region))
	}
	cfg, err := awsconfig.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("AWS_MSK_IAM: %w", err)
	}
	if cfg.Region == "" {
		return nil, errors.New("AWS_MSK_IAM: no AWS region: set the region or AWS_REGION")
	}
	return NewMSKIAM(cfg.Region, cfg.Credentials), nil
}

// NewMSKIAM is AWS_MSK_IAM with the given credentials.
func NewMSKIAM(region string, creds aws.CredentialsProvider) sasl.Mechanism {
	return &aws_msk_iam_v2.Mechanism{Signer: signer.NewSigner(), Credentials: creds, Region: region}
}
