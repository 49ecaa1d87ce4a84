package dbauth

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/azidentity"
	"github.com/aws/aws-sdk-go-v2/aws"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	rdsauth "github.com/aws/aws-sdk-go-v2/feature/rds/auth"
	"golang.org/x/oauth2"
	"golang.org/x/oauth2/google"
)

// AWSTokenLifetime is how long RDS accepts an IAM authentication token.
const AWSTokenLifetime = 15 * time.Minute

// AWSRDSIAM signs RDS IAM authentication tokens locally (SigV4, no call to
// AWS) with the credentials of the SDK's default chain: on EKS the pod's
// web identity (IRSA) or EKS Pod Identity.
type AWSRDSIAM struct {
	Region      string
	Credentials aws.CredentialsProvider
	now         func() time.Time
}

// NewAWSRDSIAM loads the SDK's default configuration; region, when not
// empty, overrides its region.
func NewAWSRDSIAM(ctx context.Context, region string) (*AWSRDSIAM, error) {
	// Temporary credentials (IRSA's web identity) are refreshed this long
	// before they expire, so that a token signed with them is good for
	// most of its 15 minutes (Token): the SDK's default is to keep them
	// to their last second.
	opts := []func(*awsconfig.LoadOptions) error{awsconfig.WithCredentialsCacheOptions(func(o *aws.CredentialsCacheOptions) {
		o.ExpiryWindow = AWSCredentialsRefreshWindow
	})}
	if region != "" {
		opts = append(opts, awsconfig.WithRegion(region))
	}
	cfg, err := awsconfig.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("aws-rds-iam: %w", err)
	}
	if cfg.Region == "" {
		return nil, errors.New("aws-rds-iam: no AWS region: set the region or AWS_REGION")
	}
	return &AWSRDSIAM{Region: cfg.Region, Credentials: cfg.Credentials, now: time.Now}, nil
}

// AWSCredentialsRefreshWindow is how long before temporary credentials
// expire the SDK fetches new ones (NewAWSRDSIAM).
const AWSCredentialsRefreshWindow = 5 * time.Minute

// Token signs a token to log in to t as t.User. RDS refuses a token once
// the credentials that signed it have expired, even within its 15
// minutes: its expiry is the earlier of the two. Before, it was always 15
// minutes, so the Source kept handing out, for up to 11 minutes, a token
// that temporary credentials close to their end had signed, and every
// connection opened meanwhile failed to log in.
func (a *AWSRDSIAM) Token(ctx context.Context, t Target) (Token, error) {
	now := time.Now
	if a.now != nil {
		now = a.now
	}
	issued := now()
	creds, err := a.Credentials.Retrieve(ctx)
	if err != nil {
		return Token{}, fmt.Errorf("aws-rds-iam: %w", err)
	}
	signer := aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) { return creds, nil })
	tok, err := rdsauth.BuildAuthToken(ctx, net.JoinHostPort(t.Host, strconv.Itoa(int(t.Port))), a.Region, t.User, signer)
	if err != nil {
		return Token{}, fmt.Errorf("aws-rds-iam: %w", err)
	}
	expiry := issued.Add(AWSTokenLifetime)
	if creds.CanExpire && creds.Expires.Before(expiry) {
		expiry = creds.Expires
	}
	return Token{Value: tok, Expiry: expiry}, nil
}

// GCPCloudSQLScope is the OAuth2 scope of Cloud SQL IAM database logins.
const GCPCloudSQLScope = "https://www.googleapis.com/auth/sqlservice.login"

// GCPCloudSQLIAM hands out OAuth2 access tokens of Google's application
// default credentials (on GKE, Workload Identity) for Cloud SQL IAM
// database authentication. The database user is the service account's
// email without ".gserviceaccount.com".
type GCPCloudSQLIAM struct {
	Tokens oauth2.TokenSource
}

// gcpTokenRequestTimeout bounds one token request of the application
// default credentials that use the context's HTTP client (a service
// account key's, a user's, an external account's; the metadata server's
// client has its own): that of net/http has none, so an endpoint that
// took the connection and never answered held the token source's lock,
// and with it every later Cloud SQL login, for good.
var gcpTokenRequestTimeout = 30 * time.Second

// NewGCPCloudSQLIAM finds the application default credentials. Some of
// them (a user's, an external account's) make their token requests with
// the context they were found with, for as long as they are used: they
// get ctx without its end, which bounds only the making, and with an HTTP
// client whose requests end after gcpTokenRequestTimeout.
func NewGCPCloudSQLIAM(ctx context.Context) (*GCPCloudSQLIAM, error) {
	ctx = context.WithValue(context.WithoutCancel(ctx), oauth2.HTTPClient, &http.Client{Timeout: gcpTokenRequestTimeout})
	creds, err := google.FindDefaultCredentials(ctx, GCPCloudSQLScope)
	if err != nil {
		return nil, fmt.Errorf("gcp-cloudsql-iam: %w", err)
	}
	return &GCPCloudSQLIAM{Tokens: creds.TokenSource}, nil
}

// Token is a fresh access token (the same for every target). The token
// source takes no context, so its call runs on its own and the caller
// waits only until ctx ends: a metadata server or token endpoint that
// does not answer would otherwise hold the connection being opened, and
// every other Cloud SQL login behind the token source's lock, past their
// deadlines. The call left running ends with its HTTP client's timeout
// (gcpTokenRequestTimeout), and its token, once there, is the source's to
// hand out.
func (g *GCPCloudSQLIAM) Token(ctx context.Context, _ Target) (Token, error) {
	type result struct {
		tok *oauth2.Token
		err error
	}
	done := make(chan result, 1)
	go func() {
		tok, err := g.Tokens.Token()
		done <- result{tok, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return Token{}, fmt.Errorf("gcp-cloudsql-iam: %w", r.err)
		}
		return Token{Value: r.tok.AccessToken, Expiry: r.tok.Expiry}, nil
	case <-ctx.Done():
		return Token{}, fmt.Errorf("gcp-cloudsql-iam: waiting for a token: %w", context.Cause(ctx))
	}
}

// AzureADScope is the scope of Azure Database for PostgreSQL's Microsoft
// Entra ID (Azure AD) logins.
const AzureADScope = "https://ossrdbms-aad.database.windows.net/.default"

// AzureAD hands out Microsoft Entra ID access tokens of the SDK's default
// credential chain (on AKS, Workload Identity).
type AzureAD struct {
	Credential azcore.TokenCredential
}

// NewAzureAD builds the default credential chain.
func NewAzureAD() (*AzureAD, error) {
	cred, err := azidentity.NewDefaultAzureCredential(nil)
	if err != nil {
		return nil, fmt.Errorf("azure-ad: %w", err)
	}
	return &AzureAD{Credential: cred}, nil
}

// Token is a fresh access token for the database scope.
func (z *AzureAD) Token(ctx context.Context, _ Target) (Token, error) {
	tok, err := z.Credential.GetToken(ctx, policy.TokenRequestOptions{Scopes: []string{AzureADScope}})
	if err != nil {
		return Token{}, fmt.Errorf("azure-ad: %w", err)
	}
	return Token{Value: tok.Token, Expiry: tok.ExpiresOn}, nil
}
